"""`jts.jit(in_shardings="annotations")` calls the entry of the previous call
directly (JAX's C++ dispatch, no Python work of ours), and whatever that entry
does not fit goes the ordinary way: warm the speculation, change one thing, call
again, and the answer must be the one a fresh function gives."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._drivers.jit import entry as _jit_entry

from .helpers import make_binary, place
from .speculation import (
    annotated_jit,
    apply,
    args_on,
    Linear,
    LOGICAL,
    Ordinary,
    W,
    want,
    X,
    Y,
)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(request.param,) * 2)


def test_steady_calls_are_speculative_and_right(mesh, monkeypatch):
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    ordinary = Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        outs = [f(m, x) for _ in range(4)]
    assert ordinary.count == 1  # the first call only
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)
        assert out.sharding.spec == P("data", "model")


def test_a_mismatch_after_warm_speculation_is_named(mesh, checker):
    # Warm, then one argument placed otherwise: JAX's dispatch refuses it, and
    # the ordinary path names it; then the right one is accepted again.
    f = jts.jit(
        make_binary(checker, X, W, Y, body=lambda x, w: x @ w),
        in_shardings="annotations",
    )
    m, x = args_on(mesh)
    with jax.set_mesh(mesh):
        f(x, m.w)
        f(x, m.w)
        rows = place(mesh, (8, 4), P(None, "data"))
        with pytest.raises(
            jts.ShardingTypeCheckError, match=r"`x` is `float32\[8,4@data\]`"
        ):
            f(rows, m.w)
        with pytest.raises(jts.ShardingTypeCheckError, match="`y` is"):
            f(x, place(mesh, (4, 2), P("model", None)))
        np.testing.assert_allclose(
            np.asarray(f(x, m.w)), np.asarray(x) @ np.asarray(m.w), rtol=1e-6
        )


def test_a_mismatch_inside_a_module_after_warm_speculation(mesh):
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        bad = Linear(place(mesh, (4, 2), P("model", None)), m.b)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`m\.w` is"):
            f(bad, x)
        moved = annotated_jit(apply, reshard_inputs=True)
        moved(m, x)
        moved(m, x)
        out = moved(bad, x)  # moved, not refused, after the warm calls
        np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)


def test_a_new_shape_is_derived_and_traced_once(mesh, monkeypatch):
    traces = []

    @jaxtyped(typechecker=beartype)
    def counted(m: Linear, x: X) -> Y:
        traces.append(x.shape)  # runs when JAX traces, never when it dispatches
        return x @ m.w + m.b

    f = annotated_jit(counted)
    m, x = args_on(mesh)
    _, big = args_on(mesh, batch=16)
    ordinary = Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        out = f(m, big)  # a miss: the entry of (8, 4) never traces (16, 4)
        assert out.shape == (16, 2)
        np.testing.assert_allclose(np.asarray(out), want(m, big), rtol=1e-6)
        f(m, big)
        f(m, x)  # a miss again, on the entry of (16, 4)
        f(m, x)
        assert ordinary.count == 3
        assert f._stale == 0  # the last call was speculative again
        # One trace per shape: a speculative call JAX's C++ cache cannot answer
        # stops before JAX traces, compares or moves anything.
        assert traces == [(8, 4), (16, 4)]
        bad = place(mesh, (16, 4), P())
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, bad)
        f(m, big)
    assert traces == [(8, 4), (16, 4)]


def test_uncommitted_arguments_after_warm_speculation(mesh):
    # NumPy and uncommitted arrays are placed as annotated, as on the first call.
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    host = np.asarray(x)
    uncommitted = jnp.asarray(host)  # outside `set_mesh`: on one device
    assert not uncommitted.committed
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        for value in (host, uncommitted):
            out = f(m, value)
            assert out.sharding.spec == P("data", "model")
            np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)


def test_the_rules_in_force_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def double(x: LOGICAL) -> LOGICAL:
        return x * 2

    f = annotated_jit(double)
    rows = place(mesh, (8, 4), P("data", None))
    with jax.set_mesh(mesh):
        with jts.axis_rules({"batch": "data", "embed": None}):
            f(rows)
            assert f(rows).sharding.spec == P("data", None)
        with jts.axis_rules({"batch": None, "embed": "data"}):
            # The same array, under rules that ask for another layout.
            with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
                f(rows)
            cols = place(mesh, (8, 4), P(None, "data"))
            assert f(cols).sharding.spec == P(None, "data")
            assert f(cols).sharding.spec == P(None, "data")
        with jts.axis_rules({"batch": "data", "embed": None}):
            with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
                f(cols)
            assert f(rows).sharding.spec == P("data", None)


def test_another_mesh_after_warm_speculation(mesh):
    # The same axis names and sizes over other devices: placed on that mesh, the
    # result is too (never the warm entry's devices).
    kind = mesh.axis_types[0]
    devices = np.asarray(jax.devices()[:8])[::-1].reshape(4, 2)
    other = Mesh(devices, ("data", "model"), axis_types=(kind, kind))
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    m2, x2 = args_on(other)
    f(m, x)
    f(m, x)
    out = f(m2, x2)
    assert out.sharding.mesh == other
    np.testing.assert_allclose(np.asarray(out), want(m2, x2), rtol=1e-6)
    with jax.set_mesh(other):  # the context's mesh decides, as on a first call
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, x)


def test_the_mode_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def cols(m: Linear, x: X) -> Float[Array, "b m", P(None, "data")]:
        return x @ m.w

    f = jts.jit(cols, in_shardings="annotations")
    m, x = args_on(mesh)
    failure = (jts.ShardingTypeCheckError, jaxtyping.TypeCheckError)
    with jax.set_mesh(mesh):
        with jts.set_mode("off"):
            f(m, x)
            f(m, x)
        with pytest.raises(failure, match="return"):
            f(m, x)
        with jts.set_mode("off"):
            assert f(m, x).shape == (8, 2)
        with pytest.raises(failure, match="return"):
            f(m, x)


def test_modes_in_turn_each_speculate(mesh, monkeypatch):
    # A benchmark times the step with checks on and off in turn: each mode keeps
    # its own speculation, and each still decides its own checks.
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    ordinary = Ordinary(f, monkeypatch)
    wrong = place(mesh, (8, 4), P())
    with jax.set_mesh(mesh):
        for _ in range(4):
            f(m, x)
            with jts.set_mode("off"):
                f(m, x)
        assert ordinary.count == 2
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, wrong)
        with jts.set_mode("off"):
            np.testing.assert_allclose(np.asarray(f(m, x)), want(m, x), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(f(m, x)), want(m, x), rtol=1e-6)


def test_inside_another_trace_after_warm_speculation(mesh):
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        out = jax.jit(lambda m, x: f(m, x) * 2)(m, x)
        np.testing.assert_allclose(np.asarray(out), 2 * want(m, x), rtol=1e-6)
        grad = jax.grad(lambda m, x: f(m, x).sum())(m, x)
        np.testing.assert_allclose(
            np.asarray(grad.w), np.asarray(x).T @ np.ones((8, 2)), rtol=1e-6
        )
        with jax.disable_jit():
            for _ in range(_jit_entry.STALE_LIMIT + 1):  # eager: not speculated
                out = f(m, x)
        np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)
        f(m, x)  # and back to the steady state
        assert f._stale == 0 and f._last
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (8, 4), P()))


def test_cleared_caches_after_warm_speculation(mesh, monkeypatch):
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    ordinary = Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        jax.clear_caches()
        out = f(m, x)  # a miss (JAX would trace again), then derived
        np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)
        f(m, x)
        assert ordinary.count == 2 and f._stale == 0
        jax.clear_caches()
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (8, 4), P()))
