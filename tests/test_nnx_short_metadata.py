"""NNX metadata naming fewer dims than its array (issue 33, item 5): a layer
stacked by `nnx.vmap` without `transform_metadata` keeps the layer's
`out_sharding`, whose names then fall on the leading dims, the stack first.
The error names the metadata, what it reads dim 0 as, and the stacked axis
missing from it, on Explicit and Auto meshes, eager and at the `jts.jit`
boundary (at trace time, and when XLA compiles)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES


nnx = pytest.importorskip("flax.nnx")

RULES = {"embed": "data", "mlp": "model", "layers": None}


class Mlp(nnx.Module):
    def __init__(self, rngs):
        w = jax.random.normal(rngs.params(), (8, 4))
        self.w = nnx.Param(w, out_sharding=("embed", "mlp"))


def _stack(meta):
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=meta)
    def stack(key):
        with nnx.use_eager_sharding(False):
            return Mlp(nnx.Rngs(key))

    return stack(jax.random.split(jax.random.key(0), 4))


def _says_why(message):
    assert "w.value" in message
    assert "NNX metadata out_sharding=('embed', 'mlp')" in message
    assert "names 2 of the array's 3 dims, so dim 0 reads as `embed`" in message
    assert "1 stacked axis is missing from out_sharding" in message
    assert "transform_metadata={nnx.PARTITION_NAME: 'layers'}" in message


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_stacked_axis_missing_from_the_metadata_is_named(kind):
    mesh = MESHES[kind]()
    with jts.axis_rules(RULES), jax.set_mesh(mesh):
        short = _stack({})
        assert short.w.get_metadata()["out_sharding"] == ("embed", "mlp")
        placed = jax.device_put(short, NamedSharding(mesh, P(None, "data", "model")))
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(placed)
        _says_why(str(info.value))

        @jts.jit
        def step(model: Mlp) -> jax.Array:
            return model.w.get_value().sum()

        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(placed)
        _says_why(str(info.value))
        # With the stacked axis in the metadata: the same array passes.
        full = _stack({nnx.PARTITION_NAME: "layers"})
        assert full.w.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
        full = jax.device_put(full, NamedSharding(mesh, P(None, "data", "model")))
        jts.check_tree(full)
        assert float(step(full)) == pytest.approx(float(jnp.sum(full.w.get_value())))
        # Metadata naming every dim says nothing of a stack when it fails.
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(jax.device_put(full, NamedSharding(mesh, P())))
        assert "stacked axis" not in str(info.value)
