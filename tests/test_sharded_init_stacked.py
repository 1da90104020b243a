"""`jts.sharded_init` of stacked layers: the extra leading dims are declared."""

import functools as ft

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

from .helpers import CHECK_ERRORS as CHECK_FAILURES, MESHES
from .test_sharded_init import _reference, _spec_is


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


def test_check_tree_of_stacked_layers(mesh):
    # check_tree takes the same declaration as sharded_init: the declared leading
    # entries, then the layer's annotation; an undeclared stack is refused.
    key = jax.random.key(0)
    piped = jts.sharded_init(Stack, key, mesh=mesh, stacked={"blocks/**": ("data",)})
    assert jts.check_tree(piped, stacked={"blocks/**": ("data",)}) is piped
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(piped, stacked={"blocks/**": 1}, name="model")
    message = str(info.value)
    assert "model.blocks.w" in message and "model.blocks.b" in message
    assert "float32[4@data,8,4@model]" in message
    with pytest.raises(CHECK_FAILURES):
        jts.check_tree(piped)  # rank 3 against a rank-2 annotation
    # A leaf moved off its layout inside the stack is named, the others are not.
    moved = eqx.tree_at(
        lambda s: s.blocks.b,
        piped,
        jax.device_put(piped.blocks.b, jax.sharding.NamedSharding(mesh, P("data"))),
    )
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(moved, stacked={"blocks/**": ("data",)}, name="model")
    assert "model.blocks.b" in str(info.value)
    assert "model.blocks.w" not in str(info.value)
    # like=: gradients laid out as the stacked parameters.
    grads = jax.tree.map(jnp.zeros_like, piped)
    jts.check_tree(grads, like=piped, stacked={"blocks/**": ("data",)}, name="grads")
    with pytest.raises(jts.ShardingTypeCheckError, match=r"g\.blocks\.b"):
        jts.check_tree(moved, like=piped, stacked={"blocks/**": ("data",)}, name="g")
    with pytest.raises(jts.ShardingAnnotationError, match="matches no leaf"):
        jts.check_tree(piped, stacked={"layers/**": 1})


def test_check_tree_of_stacked_layers_inside_jit():
    # Explicit axes: the same verdicts at trace time, through a warm cache.
    mesh = MESHES["explicit"]()
    key = jax.random.key(0)
    piped = jts.sharded_init(Stack, key, mesh=mesh, stacked={"blocks/**": ("data",)})
    seen = []

    @ft.partial(jax.jit, static_argnums=1)
    def f(model, lead):
        try:
            jts.check_tree(model, stacked={"blocks/**": lead})
            seen.append("ok")
        except jts.ShardingTypeCheckError:
            seen.append("bad")
        return model.blocks.b

    f(piped, ("data",))
    f(piped, ("data",))  # cached: no retrace
    f(piped, (None,))
    assert seen == ["ok", "bad"]
