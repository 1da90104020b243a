"""`jts.sharded_init` of stacked layers: the extra leading dims are declared."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .test_sharded_init import _reference, _spec_is, MESHES


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


@jaxtyped(typechecker=beartype)
class Block(eqx.Module):
    w: Float[Array, "embed mlp", P(None, "model")]
    b: Float[Array, "mlp", P("model")]  # noqa: F821

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 4))
        self.b = jnp.zeros(4)


@jaxtyped(typechecker=beartype)
class Stack(eqx.Module):
    blocks: Block

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, 4))


def test_stacked_layers_declared_not_guessed(mesh):
    key = jax.random.key(0)
    with pytest.raises(jts.ShardingAnnotationError, match=r"stacked=\{'blocks/w': 1\}"):
        jts.sharded_init(Stack, key, mesh=mesh)
    stack = jts.sharded_init(Stack, key, mesh=mesh, stacked={"blocks/**": 1})
    assert stack.blocks.w.shape == (4, 8, 4)
    assert _spec_is(stack.blocks.w, P(None, None, "model"))
    assert _spec_is(stack.blocks.b, P(None, "model"))
    piped = jts.sharded_init(Stack, key, mesh=mesh, stacked={"blocks/**": ("data",)})
    assert _spec_is(piped.blocks.w, P("data", None, "model"))
    want = _reference(Stack, key)
    # The same random bits; JAX 0.12 fuses the bits-to-normal float math of a
    # vmapped init differently per layout, so the last bit may differ there.
    np.testing.assert_allclose(
        np.asarray(piped.blocks.w), np.asarray(want.blocks.w), rtol=1e-6, atol=0
    )
    # `abstract` takes the same declaration: the targets a checkpoint restores.
    tree = jts.abstract(Stack, key, mesh=mesh, stacked={"blocks/**": ("data",)})
    assert tree.blocks.w.shape == (4, 8, 4)
    assert _spec_is(tree.blocks.w, P("data", None, "model"))
    assert _spec_is(tree.blocks.b, P("data", "model"))
    with pytest.raises(jts.ShardingAnnotationError, match=r"stacked=\{'blocks/w'"):
        jts.abstract(Stack, key, mesh=mesh)
    with pytest.raises(jts.ShardingAnnotationError, match="matches no leaf"):
        jts.sharded_init(Stack, key, mesh=mesh, stacked={"layers/**": 1})
    with pytest.raises(jts.ShardingAnnotationError, match="at least one dim"):
        jts.sharded_init(Stack, key, mesh=mesh, stacked={"blocks/**": 0})


def test_stack_hint_only_for_extra_dims():
    # A rule naming an axis the mesh lacks is not a stacking problem: no hint.
    mesh = MESHES["auto"]()
    logical = Float[Array, "vocab embed", jts.Logical]

    def init():
        return {"emb": jnp.zeros((64, 8)), "w": jnp.zeros((2, 3, 8, 8))}

    ann = {"emb": logical, "w": Float[Array, "embed mlp", P(None, "model")]}
    with jts.axis_rules({"vocab": "data", "embed": "modle"}):
        with pytest.raises(jts.ShardingAnnotationError) as info:
            jts.sharded_init(init, mesh=mesh, annotations=ann)
    emb, w = str(info.value).splitlines()[1:]
    assert "output['emb']" in emb and "'modle'" in emb and "stacked" not in emb
    assert "output['w']" in w and "has 2 dims, but ndim=4" in w
    assert "stacked={'w': 2}" in w  # two extra leading dims
