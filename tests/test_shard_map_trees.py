"""typed_shard_map with pytree parameters and returns: specs per leaf."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, typed_shard_map

from .helpers import place


X = Float[Array, "b@data e"]
Y = Float[Array, "b@data f@model"]
Bias = Float[Array, "f@model"]
Norm = Float[Array, "b@data"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "e f@model"]
    b: Bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Out:
    y: Y
    norms: dict[str, Norm]


def dense(mesh):
    return Dense(place(mesh, (4, 6), P(None, "model")), place(mesh, (6,), P("model")))


def test_module_and_dict_parameters_and_tree_return(mesh_4x2):
    seen = []

    @typed_shard_map(mesh=mesh_4x2)
    def f(x: X, layer: Dense, extra: dict[str, X]) -> Out:
        seen.append((x.shape, layer.w.shape, layer.b.shape, extra["z"].shape))
        y = x @ layer.w + layer.b
        return Out(y, {"n": jnp.sum(x, axis=1)})

    x = place(mesh_4x2, (8, 4), P("data"))
    layer = dense(mesh_4x2)
    out = jax.jit(f)(x, layer, {"z": x})
    assert seen[-1] == ((2, 4), (4, 3), (3,), (2, 4))  # local shards
    assert out.y.sharding.spec == P("data", "model")
    assert out.norms["n"].sharding.spec == P("data")
    want = np.asarray(x) @ np.asarray(layer.w) + np.asarray(layer.b)
    np.testing.assert_allclose(np.asarray(out.y), want, rtol=1e-5)
    # Warm caches, another call.
    jax.jit(f)(x, layer, {"z": x})


def test_tuple_return_mixing_arrays_and_trees(mesh_explicit):
    @typed_shard_map(mesh=mesh_explicit)
    def f(x: X, layer: Dense) -> tuple[Y, Dense]:
        return x @ layer.w, layer

    x = place(mesh_explicit, (8, 4), P("data"))
    y, back = f(x, dense(mesh_explicit))
    assert y.sharding.spec == P("data", "model")
    assert back.w.sharding.spec == P(None, "model") and back.w.shape == (4, 6)


def test_unannotated_leaf_is_named(mesh_explicit):
    @typed_shard_map(mesh=mesh_explicit)
    def f(x: X, extra: dict[str, jax.Array]) -> X:
        return x

    x = place(mesh_explicit, (8, 4), P("data"))
    with pytest.raises(
        jts.ShardingAnnotationError, match=r"parameter 'extra'\['z'\] has no sharded"
    ):
        f(x, {"z": x})

    @typed_shard_map(mesh=mesh_explicit)
    def g(x: X) -> dict[str, jax.Array]:
        return {"y": x}

    with pytest.raises(jts.ShardingAnnotationError, match=r"return value\['y'\]"):
        g(x)


def test_tree_leaves_checked_inside(mesh_4x2):
    # A wrong field annotation inside the body: caught by check_tree in the body.
    @typed_shard_map(mesh=mesh_4x2)
    def f(x: X, layer: Dense) -> X:
        jts.check_tree(layer, name="layer")
        jts.check_tree(layer, {"w": P(), "b": None}, name="layer")
        return x

    with pytest.raises(jts.ShardingTypeCheckError, match=r"layer.w: this local"):
        jax.jit(f)(place(mesh_4x2, (8, 4), P("data")), dense(mesh_4x2))
