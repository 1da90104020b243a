"""Malformed annotations fail when written, with an AnnotationError that teaches."""

import jax
import jaxtyping
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int


BAD = [
    # (thunk, fragment the message must contain)
    (
        lambda: Float[Array, "b e", ("data", None)],
        r"Wrap the entries: `P\('data', None\)`",
    ),
    (lambda: Float[Array, "b e", "data"], r"Wrap the axis name: `P\('data'\)`"),
    (
        lambda: Float[Array, "b e", None],
        "must be a jax.sharding.PartitionSpec, got NoneType",
    ),
    (lambda: Float[Array, "b e", 3], "must be a jax.sharding.PartitionSpec, got int"),
    (lambda: Float[Array, "b e", ["data"]], "Wrap the entries"),
    (lambda: Float[Array, "b e", P("data", "data")], "mesh axis 'data' is used twice"),
    (lambda: Float[Array, "b e", P("data", ("model", "data"))], "'data' is used twice"),
    (lambda: Float[Array, "b e", P(("x", "x"))], "'x' is used twice"),
    (
        lambda: Float[Array, "b e", P("data", None, None)],
        "has 3 entries but the dim string 'b e' has only 2",
    ),
    (
        lambda: Float[Array, "", P("data")],
        "has 1 entries but the dim string '' has only 0",
    ),
    (lambda: Float[Array, "b e", P(1)], "is not a mesh axis name"),
    (
        lambda: Float[Array, "b e", P(("a", 2))],
        "holds 2, which is not a mesh axis name",
    ),
    (lambda: Float[Array, "b e", P(P.UNCONSTRAINED)], "UNCONSTRAINED"),
    (lambda: Float[Array, "b e {U:data} {R:x}"], "braces stand only in"),
    (lambda: Float[float, "", P()], "a sharding needs an array type"),
    (lambda: Float[Float[Array, "e", P("data")], "b"], "would drop its sharding"),
    (lambda: Float[Float[Array, "e", P("data")], "b", P()], "would drop its sharding"),
    (lambda: Int[Array, "b e", P("data"), "extra"], "but got 4 arguments"),
]


@pytest.mark.parametrize("thunk, fragment", BAD)
def test_bad_annotation_fails_at_subscription(thunk, fragment):
    with pytest.raises(jaxtyping.AnnotationError, match=fragment):
        thunk()


def test_named_sharding_instead_of_spec():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(jts.ShardingAnnotationError, match="The mesh is never written"):
        Float[Array, "b e", NamedSharding(mesh, P("data"))]


def test_errors_are_annotation_errors_not_type_errors():
    # A type checker must not swallow a bad annotation as a failed check.
    assert issubclass(jts.ShardingAnnotationError, jaxtyping.AnnotationError)
    assert not issubclass(jts.ShardingAnnotationError, TypeError)
    assert jts.ShardingAnnotationError.__module__ == "jaxtyping_shard"


def test_jaxtyping_dim_errors_unchanged():
    with pytest.raises(ValueError, match="not commas"):
        Float[Array, "b,e", P("data")]
    with pytest.raises(ValueError, match="type annotations must now include"):
        Int[Array]
    with pytest.raises(ValueError, match="more than once"):
        Float[Array, "*a *b", P("data")]


def test_variadic_dim_allows_longer_spec():
    # With a variadic dim the rank is only known at check time.
    A = Float[Array, "*lead e", P("data", None, "model")]
    assert A._jts.min_rank == 3


def test_sharding_on_numpy_array_type_is_allowed():
    import numpy as np

    A = Float[np.ndarray, "b", P()]
    assert isinstance(np.ones(3, np.float32), A)
