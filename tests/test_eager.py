"""Concrete arrays: the verdict follows `Sharding.is_equivalent_to`."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Shaped

from jaxtyping_shard import Float, Int
from jaxtyping_shard._core import compat as _compat

from .helpers import CHECK_ERRORS, make_binary, make_identity, no_transfers, place


MATCHES = [
    # (array placed as, annotation spec)
    (P("data"), P("data")),
    (P("data"), P("data", None)),
    (P("data", None), P("data")),
    (P(("data",), None), P("data")),
    (P(), P()),
    (P(), P(None, None)),
    (P(None, "model"), P(None, "model")),
    (P(("data", "model")), P(("data", "model"), None)),
    (P("model", "data"), P("model", "data")),
]
MISMATCHES = [
    (P("model"), P("data")),
    (P("data"), P()),
    (P(), P("data")),
    (P("data", "model"), P("data")),
    (P(None, "model"), P("model", None)),
    (P(("data", "model")), P(("model", "data"))),
    (P(("data", "model")), P("data")),
    (P("data"), P(("data", "model"))),
]


@pytest.mark.parametrize("placed, spec", MATCHES)
def test_isinstance_match(mesh_4x2, placed, spec):
    x = place(mesh_4x2, (8, 4), placed)
    with no_transfers():
        assert isinstance(x, Float[Array, "b e", spec])


@pytest.mark.parametrize("placed, spec", MISMATCHES)
def test_isinstance_mismatch(mesh_4x2, placed, spec):
    x = place(mesh_4x2, (8, 4), placed)
    with no_transfers():
        assert not isinstance(x, Float[Array, "b e", spec])


@pytest.mark.parametrize("placed, spec", MATCHES + MISMATCHES)
def test_verdict_is_jax_equivalence(mesh_4x2, placed, spec):
    x = place(mesh_4x2, (8, 4), placed)
    expected = NamedSharding(mesh_4x2, spec).is_equivalent_to(x.sharding, 2)
    assert isinstance(x, Float[Array, "b e", spec]) == expected


@pytest.mark.parametrize("placed, spec", MATCHES)
def test_checked_function_match(checker, mesh_explicit, placed, spec):
    A = Float[Array, "b e", spec]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), placed)
    with no_transfers():
        assert f(x) is x


@pytest.mark.parametrize("placed, spec", MISMATCHES)
def test_checked_function_mismatch(checker, mesh_explicit, placed, spec):
    A = Float[Array, "b e", spec]
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), placed)
    with no_transfers(), pytest.raises(CHECK_ERRORS):
        f(x)


def test_return_value_checked(checker, mesh_explicit):
    f = make_identity(
        checker, Float[Array, "b e"], Float[Array, "b e", P("model", None)]
    )
    x = place(mesh_explicit, (8, 4), P("data"))
    with no_transfers(), pytest.raises(CHECK_ERRORS, match="return"):
        f(x)
    y = place(mesh_explicit, (8, 4), P("model"))
    with no_transfers():
        assert f(y) is y


def test_size_one_axis_is_not_sharding(checker):
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    A = Float[Array, "b e", P("data", "model")]
    f = make_identity(checker, A, A)
    x = place(mesh, (8, 4), P("data"))  # "model" has size 1: the same layout
    with no_transfers():
        assert f(x) is x
    assert isinstance(
        place(mesh, (8, 4), P("data", "model")), Float[Array, "b e", P("data")]
    )
    assert not isinstance(
        place(mesh, (8, 4), P("model")), Float[Array, "b e", P("data")]
    )


def test_three_axis_mesh(mesh_2x2x2):
    x = place(mesh_2x2x2, (8, 4, 2), P(("x", "y"), "z"))
    assert isinstance(x, Float[Array, "a b c", P(("x", "y"), "z", None)])
    assert not isinstance(x, Float[Array, "a b c", P(("y", "x"), "z")])
    assert not isinstance(x, Float[Array, "a b c", P("x", "z")])


def test_two_arguments_bind_the_same_dim(checker, mesh_explicit):
    A = Float[Array, "batch embed", P("data", None)]
    f = make_binary(checker, A, A, Float[Array, "batch embed"])
    x = place(mesh_explicit, (8, 4), P("data"))
    y = place(mesh_explicit, (8, 4), P("data"))
    z = place(mesh_explicit, (4, 4), P("data"))  # right sharding, wrong batch
    w = place(mesh_explicit, (8, 4), P("model"))  # right shape, wrong sharding
    with no_transfers():
        assert f(x, y) is x
        with pytest.raises(CHECK_ERRORS):
            f(x, z)
        with pytest.raises(CHECK_ERRORS):
            f(x, w)


def test_shape_and_dtype_still_checked(mesh_explicit):
    x = place(mesh_explicit, (8, 4), P("data"))
    assert not isinstance(x, Float[Array, "b", P("data")])
    assert not isinstance(x, Int[Array, "b e", P("data")])
    assert isinstance(x, Shaped[Array, "b e"])
    i = place(mesh_explicit, (8, 4), P("data"), dtype=jnp.int32)
    assert isinstance(i, Int[Array, "b e", P("data")])


def test_single_device_array():
    x = jnp.ones((8, 4))
    assert isinstance(x, Float[Array, "b e", P()])
    assert isinstance(x, Float[Array, "b e", P(None, None)])
    assert not isinstance(x, Float[Array, "b e", P("data")])


def test_single_device_array_with_context_mesh():
    x = jnp.ones((8, 4))
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        assert isinstance(x, Float[Array, "b e", P("model")])  # size 1
        assert not isinstance(x, Float[Array, "b e", P("data")])
        unknown = Float[Array, "b e", P("fsdp")]
        assert not isinstance(x, unknown)  # an axis the mesh lacks: no match
        assert "names mesh axis 'fsdp'" in unknown.__instancecheck_str__(x)


def test_numpy_array_is_on_one_device():
    x = np.ones((8, 4), np.float32)
    assert isinstance(x, Float[np.ndarray, "b e", P()])
    assert not isinstance(x, Float[np.ndarray, "b e", P("data")])


def test_union_array_type(checker, mesh_explicit):
    # `isinstance` on a `typing.Union` is a subclass check in Python, so the union
    # is tested through a checker, as users meet it.
    A = Float[Array | np.ndarray, "b e", P("data")]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("data"))
    assert f(x) is x
    with pytest.raises(CHECK_ERRORS):
        f(place(mesh_explicit, (8, 4), P("model")))
    with pytest.raises(CHECK_ERRORS):
        f(np.ones((8, 4), np.float32))


def test_unknown_mesh_axis_does_not_match(mesh_explicit):
    # Not an annotation error: the annotation may be a Union member for another
    # mesh (tests/test_unions.py). The reason names the axis and the mesh's axes.
    x = place(mesh_explicit, (8, 4), P("data"))
    unknown = Float[Array, "b e", P("fsdp")]
    assert not isinstance(x, unknown)
    reason = unknown.__instancecheck_str__(x)
    assert "'fsdp'" in reason
    assert "'data', 'model'" in reason


def test_unknown_mesh_axis_through_checker(checker, mesh_explicit):
    A = Float[Array, "b e", P("batch")]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("data"))
    with pytest.raises(CHECK_ERRORS, match="'batch'"):
        f(x)


def test_variadic_dims(mesh_explicit):
    A = Float[Array, "*lead e", P("data")]
    assert isinstance(place(mesh_explicit, (8, 4), P("data")), A)
    assert isinstance(place(mesh_explicit, (8, 2, 4), P("data")), A)
    assert not isinstance(place(mesh_explicit, (8, 2, 4), P(None, "model")), A)
    B = Float[Array, "... e", P("data", "model")]
    assert not isinstance(place(mesh_explicit, (8,), P("data")), B)  # rank too low


def test_verdict_cache_is_per_sharding(mesh_explicit):
    A = Float[Array, "b e", P("data")]
    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    for _ in range(3):
        assert isinstance(good, A)
        assert not isinstance(bad, A)
    assert len(A._jts_verdicts) == 2


def test_cache_is_not_fooled_by_context_mesh():
    A = Float[Array, "b e", P("model")]
    x = jnp.ones((8, 4))
    assert not isinstance(x, A)
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        assert isinstance(x, A)
    assert not isinstance(x, A)


def test_legacy_with_mesh_context():
    x = jnp.ones((8, 4))
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    # JAX deprecates `with mesh:` from 0.10.1 (docs/compat.md); before, no warning.
    expected = (
        pytest.warns(DeprecationWarning)
        if _compat.legacy_mesh_context_warns()
        else contextlib.nullcontext()
    )
    with expected, mesh:
        assert isinstance(x, Float[Array, "b e", P("model")])
        assert not isinstance(x, Float[Array, "b e", P("data")])
