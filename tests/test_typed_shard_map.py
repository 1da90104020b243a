"""typed_shard_map: in_specs / out_specs read from the annotations."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float, typed_shard_map

from .helpers import CHECK_ERRORS, place


X = Float[Array, "b@data e"]
W = Float[Array, "e f@model"]
Y = Float[Array, "b@data f@model"]


def test_specs_from_annotations(mesh_4x2):
    seen = []

    @typed_shard_map(mesh=mesh_4x2)
    def f(x: X, w: W) -> Y:
        seen.append((x.shape, w.shape))
        return x @ w

    x = place(mesh_4x2, (8, 4), P("data"))
    w = place(mesh_4x2, (4, 6), P(None, "model"))
    out = jax.jit(f)(x, w)
    assert seen == [((2, 4), (4, 3))]  # local shards: 8/4 rows, 6/2 columns
    assert out.shape == (8, 6)
    assert out.sharding.is_equivalent_to(
        jax.NamedSharding(mesh_4x2, P("data", "model")), 2
    )
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(x) @ np.asarray(w), rtol=1e-5
    )


def test_tuple_return_and_context_mesh(mesh_explicit):
    @typed_shard_map
    def f(x: X) -> tuple[X, Float[Array, "r e", P()]]:
        return x, jax.lax.psum(x, "data")

    x = place(mesh_explicit, (8, 4), P("data"))
    with jax.set_mesh(mesh_explicit):
        a, b = jax.jit(f)(x)
    assert a.shape == (8, 4)
    assert b.shape == (2, 4)  # replicated: the global array is one local block
    np.testing.assert_allclose(np.asarray(b), np.asarray(x).reshape(4, 2, 4).sum(0))


def test_checked_inside(checker, mesh_4x2):
    # With jaxtyped inside, a wrong annotation on an intermediate is caught.
    from .helpers import make_identity

    wrong = make_identity(checker, Float[Array, "b e"], Float[Array, "b e", P()])

    @typed_shard_map(mesh=mesh_4x2)
    def f(x: X) -> X:
        return wrong(x)  # varies over data, annotated replicated

    with pytest.raises(CHECK_ERRORS):
        jax.jit(f)(place(mesh_4x2, (8, 4), P("data")))


def test_body_annotations_bind_global_dims(mesh_explicit):
    @typed_shard_map(mesh=mesh_explicit)
    @jaxtyped(typechecker=beartype)
    def f(
        x: Float[Array, "8@data e"], w: Float[Array, "e f@model"]
    ) -> Float[Array, "8@data f@model"]:
        return x @ w

    x = place(mesh_explicit, (8, 4), P("data"))
    w = place(mesh_explicit, (4, 6), P(None, "model"))
    assert f(x, w).shape == (8, 6)
    with pytest.raises(CHECK_ERRORS):  # 16 global rows, annotated 8
        f(place(mesh_explicit, (16, 4), P("data")), w)


def test_missing_annotation_is_a_decoration_error():
    with pytest.raises(
        jts.ShardingAnnotationError, match="parameter 'w' has no annotation"
    ):

        @typed_shard_map
        def f(x: X, w) -> X:
            return x


def test_unsharded_annotation_is_a_decoration_error():
    with pytest.raises(jts.ShardingAnnotationError, match="which has no sharding"):

        @typed_shard_map
        def f(x: Float[Array, "b e"]) -> X:
            return x

    with pytest.raises(
        jts.ShardingAnnotationError, match="the return value has no annotation"
    ):

        @typed_shard_map
        def g(x: X):
            return x


def test_variadic_parameters_refused():
    with pytest.raises(jts.ShardingAnnotationError, match="is variadic"):

        @typed_shard_map
        def f(*xs: X) -> X:
            return xs[0]


def test_variadic_return_rank_refused():
    with pytest.raises(jts.ShardingAnnotationError, match="after a variadic dim"):

        @typed_shard_map
        def f(x: X) -> Float[Array, "*b e@model"]:
            return x


def test_partial_manual_axes(mesh_explicit):
    seen = []

    @typed_shard_map(mesh=mesh_explicit, axis_names={"model"})
    def f(x: Float[Array, "b@data f@model"]) -> Float[Array, "b@data f@model"]:
        seen.append(jax.typeof(x))
        assert isinstance(x, Float[Array, "b@data f@model"])
        assert not isinstance(x, Float[Array, "b f@model"])  # explicit data part
        return x * 2

    x = place(mesh_explicit, (8, 6), P("data", "model"))
    out = jax.jit(f)(x)
    assert out.shape == (8, 6)
    assert tuple(seen[0].shape) == (8, 3)  # only `model` is manual


def test_nested_in_jit_auto(mesh_auto):
    @typed_shard_map(mesh=mesh_auto)
    @jaxtyped(typechecker=beartype)
    def f(x: X, w: W) -> Y:
        return x @ w

    x = place(mesh_auto, (8, 4), P("data"))
    w = place(mesh_auto, (4, 6), P(None, "model"))
    assert jts.jit(f)(x, w).shape == (8, 6)


def test_example_runs():
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "tp_mlp.py")
    out = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the unsharded result" in out.stdout
    assert "forgetting the psum is caught" in out.stdout
