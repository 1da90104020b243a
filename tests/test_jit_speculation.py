"""`jts.jit(in_shardings="annotations")` calls the entry of the previous call
directly (JAX's C++ dispatch, no Python work of ours), and whatever that entry
does not fit goes the ordinary way: warm the speculation, change one thing, call
again, and the answer must be the one a fresh function gives."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import _jit_entry, Float

from .helpers import make_binary, place


X = Float[Array, "b e", P("data", None)]
W = Float[Array, "e m", P(None, "model")]
Y = Float[Array, "b m", P("data", "model")]
LOGICAL = Float[Array, "batch embed", jts.Logical]


class Linear(eqx.Module):
    w: W
    b: Float[Array, "m"]  # noqa: F821


@jaxtyped(typechecker=beartype)
def apply(m: Linear, x: X) -> Y:
    return x @ m.w + m.b


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(request.param,) * 2)


def _args(mesh, batch=8):
    m = Linear(place(mesh, (4, 2), P(None, "model")), place(mesh, (2,), P()))
    return m, place(mesh, (batch, 4), P("data", None))


def _want(m, x):
    return np.asarray(x) @ np.asarray(m.w) + np.asarray(m.b)


class _Ordinary:
    """Counts the calls that went the ordinary way (derived here, not speculated)."""

    def __init__(self, f, monkeypatch):
        self.count = 0
        prepare = f._prepare

        def counted(*args, **kwargs):
            self.count += 1
            return prepare(*args, **kwargs)

        monkeypatch.setattr(f, "_prepare", counted)


def _jit(fun, **kwargs):
    return jts.jit(
        fun, in_shardings="annotations", out_shardings="annotations", **kwargs
    )


def test_steady_calls_are_speculative_and_right(mesh, monkeypatch):
    f = _jit(apply)
    m, x = _args(mesh)
    ordinary = _Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        outs = [f(m, x) for _ in range(4)]
    assert ordinary.count == 1  # the first call only
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)
        assert out.sharding.spec == P("data", "model")


def test_a_mismatch_after_warm_speculation_is_named(mesh, checker):
    # Warm, then one argument placed otherwise: JAX's dispatch refuses it, and
    # the ordinary path names it; then the right one is accepted again.
    f = jts.jit(
        make_binary(checker, X, W, Y, body=lambda x, w: x @ w),
        in_shardings="annotations",
    )
    m, x = _args(mesh)
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
    f = _jit(apply)
    m, x = _args(mesh)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        bad = Linear(place(mesh, (4, 2), P("model", None)), m.b)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`m\.w` is"):
            f(bad, x)
        moved = _jit(apply, reshard_inputs=True)
        moved(m, x)
        moved(m, x)
        out = moved(bad, x)  # moved, not refused, after the warm calls
        np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)


def test_a_new_shape_is_derived_and_traced_once(mesh, monkeypatch):
    traces = []

    @jaxtyped(typechecker=beartype)
    def counted(m: Linear, x: X) -> Y:
        traces.append(x.shape)  # runs when JAX traces, never when it dispatches
        return x @ m.w + m.b

    f = _jit(counted)
    m, x = _args(mesh)
    _, big = _args(mesh, batch=16)
    ordinary = _Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        out = f(m, big)  # a miss: the entry of (8, 4) never traces (16, 4)
        assert out.shape == (16, 2)
        np.testing.assert_allclose(np.asarray(out), _want(m, big), rtol=1e-6)
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
    f = _jit(apply)
    m, x = _args(mesh)
    host = np.asarray(x)
    uncommitted = jnp.asarray(host)  # outside `set_mesh`: on one device
    assert not uncommitted.committed
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        for value in (host, uncommitted):
            out = f(m, value)
            assert out.sharding.spec == P("data", "model")
            np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)


def test_the_rules_in_force_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def double(x: LOGICAL) -> LOGICAL:
        return x * 2

    f = _jit(double)
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
    f = _jit(apply)
    m, x = _args(mesh)
    m2, x2 = _args(other)
    f(m, x)
    f(m, x)
    out = f(m2, x2)
    assert out.sharding.mesh == other
    np.testing.assert_allclose(np.asarray(out), _want(m2, x2), rtol=1e-6)
    with jax.set_mesh(other):  # the context's mesh decides, as on a first call
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, x)


def test_the_mode_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def cols(m: Linear, x: X) -> Float[Array, "b m", P(None, "data")]:
        return x @ m.w

    f = jts.jit(cols, in_shardings="annotations")
    m, x = _args(mesh)
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
    f = _jit(apply)
    m, x = _args(mesh)
    ordinary = _Ordinary(f, monkeypatch)
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
            np.testing.assert_allclose(np.asarray(f(m, x)), _want(m, x), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(f(m, x)), _want(m, x), rtol=1e-6)


def test_inside_another_trace_after_warm_speculation(mesh):
    f = _jit(apply)
    m, x = _args(mesh)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        out = jax.jit(lambda m, x: f(m, x) * 2)(m, x)
        np.testing.assert_allclose(np.asarray(out), 2 * _want(m, x), rtol=1e-6)
        grad = jax.grad(lambda m, x: f(m, x).sum())(m, x)
        np.testing.assert_allclose(
            np.asarray(grad.w), np.asarray(x).T @ np.ones((8, 2)), rtol=1e-6
        )
        with jax.disable_jit():
            for _ in range(_jit_entry.STALE_LIMIT + 1):  # eager: not speculated
                out = f(m, x)
        np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)
        f(m, x)  # and back to the steady state
        assert f._stale == 0 and f._last
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (8, 4), P()))


def test_cleared_caches_after_warm_speculation(mesh, monkeypatch):
    f = _jit(apply)
    m, x = _args(mesh)
    ordinary = _Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        f(m, x)
        f(m, x)
        jax.clear_caches()
        out = f(m, x)  # a miss (JAX would trace again), then derived
        np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)
        f(m, x)
        assert ordinary.count == 2 and f._stale == 0
        jax.clear_caches()
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (8, 4), P()))


def test_alternating_signatures_stop_speculating(mesh, monkeypatch):
    f = _jit(apply)
    m, x = _args(mesh)
    _, big = _args(mesh, batch=16)
    ordinary = _Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        for _ in range(_jit_entry.STALE_LIMIT + 4):
            for value in (x, big):
                out = f(m, value)
                np.testing.assert_allclose(np.asarray(out), _want(m, value), rtol=1e-6)
        assert f._stale == _jit_entry.STALE_LIMIT and not f._last
        calls = 2 * (_jit_entry.STALE_LIMIT + 4)
        assert ordinary.count == calls
        # Still checked, through the flat jits now.
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (16, 4), P()))
    assert all(e._flat is not None for e in f._cache.values())


def test_static_and_keyword_arguments_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def scaled(x: X, scale: float = 1.0) -> X:
        return x * scale

    f = jts.jit(scaled, in_shardings="annotations", static_argnums=1)
    _, x = _args(mesh)
    with jax.set_mesh(mesh):
        f(x, 2.0)
        f(x, 2.0)
        np.testing.assert_allclose(np.asarray(f(x, 3.0)), 3 * np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x, scale=5.0)), 5 * np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x, 3.0)), 3 * np.asarray(x))
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(place(mesh, (8, 4), P()), 3.0)


def test_threads_with_different_signatures(mesh):
    # Each thread's speculation is its own; a stale one in one thread never lets
    # another thread's wrong argument through.
    f = _jit(apply)
    m, x = _args(mesh)
    _, big = _args(mesh, batch=16)
    wrong = place(mesh, (8, 4), P())
    errors: list = []

    def run(value, bad):
        try:
            with jax.set_mesh(mesh):
                for _ in range(10):
                    out = f(m, value)
                    np.testing.assert_allclose(
                        np.asarray(out), _want(m, value), rtol=1e-6
                    )
                    if bad is not None:
                        with pytest.raises(jts.ShardingTypeCheckError):
                            f(m, bad)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=args)
        for args in ((x, None), (big, None), (x, wrong))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_the_flat_jit_serves_what_speculation_cannot(mesh):
    # Host arrays every call: nothing committed, nothing to speculate on; the
    # flat jit serves each call, with the derived placement.
    f = _jit(apply)
    m, x = _args(mesh)
    host = np.asarray(x)
    with jax.set_mesh(mesh):
        for _ in range(2):
            out = f(m, host)
            assert out.sharding.spec == P("data", "model")
    assert not f._last
    (entry,) = f._cache.values()
    assert entry._flat is not None and entry._tree is None


def test_arguments_moved_on_every_call_stop_speculating(mesh):
    # reshard_inputs=True with an argument placed otherwise each time: the first
    # speculative call (the previous signature's) is refused before the ordinary
    # path moves it; a signature whose arguments must be moved is never
    # speculated on, so no more tries.
    f = _jit(apply, reshard_inputs=True)
    m, x = _args(mesh)
    rows = place(mesh, (8, 4), P())
    with jax.set_mesh(mesh):
        f(m, x)
        for _ in range(_jit_entry.STALE_LIMIT + 3):
            out = f(m, rows)
            assert out.sharding.spec == P("data", "model")
            np.testing.assert_allclose(np.asarray(out), _want(m, x), rtol=1e-6)
    assert f._stale == 1 and not f._last


def test_uncommitted_unannotated_arguments_keep_speculating(mesh, monkeypatch):
    # A scale made at top level each step (uncommitted, no sharding asked for):
    # JAX's C++ cache places it as on the first call, no Python of ours.
    @jaxtyped(typechecker=beartype)
    def scaled(x: X, s: Float[Array, ""]) -> X:
        return x * s

    f = _jit(scaled)
    _, x = _args(mesh)
    ordinary = _Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        for i in range(_jit_entry.STALE_LIMIT + 3):
            s = jnp.float32(i)
            np.testing.assert_allclose(np.asarray(f(x, s)), i * np.asarray(x))
    assert ordinary.count == 1 and f._stale == 0
