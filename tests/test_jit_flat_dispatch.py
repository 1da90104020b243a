"""`jts.jit` with every sharding derived calls a `jit` over the arguments' flat
leaves (JAX flattens a tuple of arrays, not the modules a second time). The
results, the compiles, the checks through JAX's caches and the keyword arguments
of `jit` must be as if the function itself were jitted."""

import equinox as eqx
import jax
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import Compiles, place


X = Float[Array, "b e", P("data", None)]
W = Float[Array, "e m", P(None, "model")]
Y = Float[Array, "b m", P("data", "model")]
COLS = Float[Array, "b m", P(None, "data")]  # not what `x @ w` gives


class Linear(eqx.Module):
    w: W
    b: Float[Array, "m"]  # noqa: F821


@jaxtyped(typechecker=beartype)
def apply(m: Linear, x: X, scale: float) -> Y:
    return (x @ m.w + m.b) * scale


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(request.param,) * 2)


def _args(mesh):
    m = Linear(place(mesh, (4, 2), P(None, "model")), place(mesh, (2,), P()))
    return m, place(mesh, (8, 4), P("data", None))


def test_one_compile_per_signature_and_the_same_values(mesh):
    f = jts.jit(
        apply, in_shardings="annotations", out_shardings="annotations", static_argnums=2
    )
    m, x = _args(mesh)
    want = (np.asarray(x) @ np.asarray(m.w) + np.asarray(m.b)) * 2.0
    with jax.set_mesh(mesh), Compiles() as compiles:
        outs = [f(m, x, 2.0) for _ in range(3)]
        assert compiles.count == 1
        for out in outs:
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
            assert out.sharding.spec == P("data", "model")
        halved = f(m, x, 0.5)  # another static value: its own compile
        assert compiles.count == 2
        np.testing.assert_allclose(np.asarray(halved), want / 4, rtol=1e-6)
        # Each signature's calls went through one jit only: of the function itself,
        # where later calls go straight to it (see test_jit_speculation.py).
        entries = list(f._cache.values())
        assert len(entries) == 2
        assert all(e._flat is None and e._tree is not None for e in entries)
        # lower / trace / eval_shape take the arguments as given.
        lowered = f.lower(m, x, 2.0)
        assert lowered.compile().input_shardings[0][0].w.spec == P(None, "model")
        assert f.eval_shape(m, x, 2.0).shape == (8, 2)


def test_mode_and_a_wrong_body_through_the_caches(mesh):
    # Warm in mode off, then check: the flat jit is a jax.jit, whose caches key
    # on the mode; and back.
    @jaxtyped(typechecker=beartype)
    def cols(m: Linear, x: X) -> COLS:
        return x @ m.w

    f = jts.jit(cols, in_shardings="annotations")
    m, x = _args(mesh)
    failure = (jts.ShardingTypeCheckError, jaxtyping.TypeCheckError)
    with jax.set_mesh(mesh):
        with jts.set_mode("off"):
            assert f(m, x).shape == (8, 2)
            assert f(m, x).shape == (8, 2)
        with pytest.raises(failure, match="return"):
            f(m, x)
        with jts.set_mode("off"):
            assert f(m, x).shape == (8, 2)


def test_mismatch_after_a_warm_cache_names_the_leaf(mesh):
    f = jts.jit(apply, in_shardings="annotations", static_argnums=2)
    m, x = _args(mesh)
    with jax.set_mesh(mesh):
        f(m, x, 1.0)
        f(m, x, 1.0)
        bad = Linear(place(mesh, (4, 2), P("model", None)), m.b)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`m\.w` is"):
            f(bad, x, 1.0)
        moved = jts.jit(
            apply, in_shardings="annotations", static_argnums=2, reshard_inputs=True
        )
        moved(m, x, 1.0)
        assert moved(bad, x, 1.0).shape == (8, 2)


def test_donation_as_jax_jit_does_it():
    # Donated arguments are numbered by the caller: such a jts.jit calls the
    # function itself, and donates as jax.jit does.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    @jaxtyped(typechecker=beartype)
    def double(x: X) -> X:
        return x * 2

    f = jts.jit(double, in_shardings="annotations", donate_argnums=0)
    plain = jax.jit(double, donate_argnums=0)
    with jax.set_mesh(mesh):
        x, y = (place(mesh, (8, 4), P("data", None)) for _ in range(2))
        want = 2 * np.asarray(x)
        np.testing.assert_array_equal(np.asarray(f(x)), want)
        plain(y)
    assert x.is_deleted() == y.is_deleted()
    # Warm calls (speculative from the second: JAX's C++ dispatch, donating each
    # time), then a mismatched argument is still named, and nothing donated.
    with jax.set_mesh(mesh):
        for _ in range(3):
            x = place(mesh, (8, 4), P("data", None))
            want = 2 * np.asarray(x)
            np.testing.assert_array_equal(np.asarray(f(x)), want)
            assert x.is_deleted()
        wrong = place(mesh, (8, 4), P(None, "data"))
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(wrong)
        assert not wrong.is_deleted()  # a refused call donates nothing
