"""The bridge: spec_of, sharding_of and shardings, from annotations to shardings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int

from .helpers import no_transfers


Bias = Float[Array, "mlp@model"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "embed mlp", P(None, "model")]
    b: Bias
    scale: Float[Array, ""]  # no sharding: None in shardings()


def test_spec_of_forms():
    assert jts.spec_of(Float[Array, "b e", P("data", None)]) == P("data", None)
    assert jts.spec_of(Float[Array, "b e", P("data")]) == P("data", None)
    assert jts.spec_of(Float[Array, "b@data e@model"]) == P("data", "model")
    assert jts.spec_of(Float[Array, "b@(data,model) e"]) == P(("data", "model"), None)
    assert jts.spec_of(Int[Array, "b e", P()]) == P(None, None)
    assert jts.spec_of(P("data")) == P("data")
    assert jts.spec_of(Float[Array | np.ndarray, "b@data"]) == P("data")


def test_spec_of_variadic_needs_ndim():
    ann = Float[Array, "*lead seq@model"]
    assert jts.spec_of(ann, ndim=3) == P(None, None, "model")
    assert jts.spec_of(ann, ndim=1) == P("model")
    with pytest.raises(jts.ShardingAnnotationError, match="pass `ndim=`"):
        jts.spec_of(ann)
    # Nothing after the variadic dim: the leading dims are known without ndim.
    assert jts.spec_of(Float[Array, "b@data *rest"]) == P("data")
    assert jts.spec_of(Float[Array, "b@data *rest"], ndim=3) == P("data", None, None)


def test_spec_of_errors():
    with pytest.raises(jts.ShardingAnnotationError, match="has no sharding"):
        jts.spec_of(Float[Array, "b e"])
    with pytest.raises(jts.ShardingAnnotationError, match="has 2 dims, but ndim=3"):
        jts.spec_of(Float[Array, "b@data e"], ndim=3)
    with pytest.raises(jts.ShardingAnnotationError, match="shards 3 dims"):
        jts.spec_of(Float[Array, "*lead a@data b c@model"], ndim=2)
    with pytest.raises(jts.ShardingAnnotationError, match="has no sharding"):
        jts.spec_of(int)


def test_sharding_of(mesh_4x2):
    s = jts.sharding_of(Float[Array, "b@data e"], mesh_4x2)
    assert s == NamedSharding(mesh_4x2, P("data", None))
    x = jax.device_put(jnp.zeros((8, 4)), s)
    assert isinstance(x, Float[Array, "b@data e"])
    with jax.set_mesh(mesh_4x2):
        assert jts.sharding_of(P(None, "model")).spec == P(None, "model")
        assert jts.sharding_of(P("data")).mesh == mesh_4x2
    given = NamedSharding(mesh_4x2, P("model"))
    assert jts.sharding_of(given) is given


def test_sharding_of_errors(mesh_2x2x2):
    with pytest.raises(jts.ShardingAnnotationError, match="names mesh axis 'data'"):
        jts.sharding_of(Float[Array, "b@data e"], mesh_2x2x2)
    with pytest.raises(ValueError, match="needs a mesh"):
        jts.sharding_of(Float[Array, "b@x e"])


def test_sharding_of_inside_jit_uses_the_abstract_mesh(mesh_explicit):
    @jax.jit
    def f(x):
        return jax.sharding.reshard(x, jts.sharding_of(Float[Array, "b@data e"]))

    with jax.set_mesh(mesh_explicit):
        out = f(jnp.zeros((8, 4)))
    assert out.sharding.spec == P("data", None)


def test_the_concrete_context_mesh_outside_jit_only(mesh_4x2):
    # `jax.sharding.get_mesh` (public since the supported floor, jax 0.8.1) gives
    # the `Mesh` that `jax.set_mesh` set outside `jit` and raises inside.
    from jaxtyping_shard._core import mesh as _mesh

    assert _mesh.set_concrete_mesh() is None
    seen = []

    @jax.jit
    def f(x):
        seen.append((_mesh.set_concrete_mesh(), _mesh.concrete_context_mesh()))
        return x

    with jax.set_mesh(mesh_4x2):
        assert _mesh.set_concrete_mesh() is mesh_4x2
        f(jnp.zeros(2))
    inside, context = seen[0]
    assert inside is None
    assert context == mesh_4x2.abstract_mesh  # only the abstract mesh in a trace


def test_shardings_of_abstract_tree(mesh_4x2):
    init = lambda: Dense(jnp.zeros((4, 8)), jnp.zeros(8), jnp.ones(()))
    abstract = jax.eval_shape(init)
    out = jts.shardings(abstract, mesh_4x2)
    assert out.w == NamedSharding(mesh_4x2, P(None, "model"))
    assert out.b == NamedSharding(mesh_4x2, P("model"))
    assert out.scale is None
    params = jax.jit(init, out_shardings=out)()
    assert params.w.sharding.is_equivalent_to(out.w, 2)
    assert params.b.sharding.is_equivalent_to(out.b, 1)


def test_shardings_as_device_put_and_process_local_targets(mesh_4x2):
    params = Dense(jnp.ones((4, 8)), jnp.ones(8), jnp.ones(()))
    target = jts.shardings(params, mesh_4x2)
    placed = jax.device_put(params, target)
    assert placed.w.sharding.spec == P(None, "model")
    w = jax.make_array_from_process_local_data(target.w, np.ones((4, 8), np.float32))
    assert w.sharding == target.w
    with no_transfers():
        jts.shardings(placed, mesh_4x2)  # reads shapes only


def test_shardings_context_mesh_and_errors(mesh_4x2, mesh_2x2x2):
    tree = {"a": jnp.zeros((8, 4))}
    with jax.set_mesh(mesh_4x2):
        out = jts.shardings(tree, annotations={"a": P("data")})
    assert out["a"].mesh == mesh_4x2
    with pytest.raises(jts.ShardingAnnotationError, match=r"tree\['a'\].*'data'"):
        jts.shardings(tree, mesh_2x2x2, annotations={"a": P("data")})
    with pytest.raises(ValueError, match="needs a mesh"):
        jts.shardings(tree, annotations={"a": P("data")})
    # Nothing sharded: no mesh needed.
    assert jts.shardings(tree) == {"a": None}


def test_named_sharding_annotations_keep_their_mesh(mesh_4x2):
    given = NamedSharding(mesh_4x2, P("model"))
    out = jts.shardings({"a": jnp.zeros(4)}, annotations={"a": given})
    assert out["a"] is given


def test_explicit_and_auto_meshes_give_the_same_specs():
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
        out = jts.shardings(
            jax.eval_shape(
                lambda: Dense(jnp.zeros((4, 8)), jnp.zeros(8), jnp.ones(()))
            ),
            mesh,
        )
        assert out.w.spec == P(None, "model") and out.w.mesh == mesh
