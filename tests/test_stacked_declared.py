"""`jts.Stacked[Block, ...]`: a stack declared once, where the field (or the
parameter) is declared; malformed declarations fail when written, a leaf
declared both ways is an error naming it (issue 23, item 3)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, MESHES


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


class Block(eqx.Module):
    w: Float[Array, "embed mlp", P(None, "model")]
    scale: Array  # declares no sharding: stays unannotated when stacked

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 4))
        self.scale = jnp.ones(())


def _stack(key, *counts):
    make = Block
    for _ in counts:
        make = eqx.filter_vmap(make)
    keys = jax.random.split(key, counts[0] * (counts[1] if len(counts) > 1 else 1))
    return make(keys.reshape(*counts))


class Deep(eqx.Module):  # two stacked dims: stages x layers
    blocks: jts.Stacked[Block, 2]

    def __init__(self, key):
        self.blocks = _stack(key, 2, 3)


class Nested(eqx.Module):  # a stack inside a stack: the dims add up
    inner: jts.Stacked[Block]


class Outer(eqx.Module):
    stages: jts.Stacked[Nested, ("data",)]  # noqa: F821

    def __init__(self, key):
        self.stages = eqx.filter_vmap(lambda k: Nested(_stack(k, 3)))(
            jax.random.split(key, 4)
        )


@pytest.mark.parametrize(
    "write",
    [
        lambda: jts.Stacked[Block, 0],
        lambda: jts.Stacked[Block, -1],
        lambda: jts.Stacked[Block, "x"],
        lambda: jts.Stacked[Block, True],
        lambda: jts.Stacked[Block, ()],
        lambda: jts.Stacked[Block, ("data", 3)],
        lambda: jts.Stacked[3],
        lambda: jts.Stacked["Block"],
        lambda: jts.Stacked[Block, 1, 2],
    ],
)
def test_malformed_fails_when_written(write):
    with pytest.raises(jts.ShardingAnnotationError, match="Stacked"):
        write()


def test_written_forms():
    assert jts.Stacked[Block] == jts.Stacked[Block, 1]
    assert "Stacked(None, None)" in repr(jts.Stacked[Block, 2])
    assert "Stacked('data',)" in repr(jts.Stacked[Block, ("data",)])
    with pytest.raises(TypeError):
        jts.Stacked()


def test_beartype_reads_it_as_the_layer_class():
    @jaxtyped(typechecker=beartype)
    def count(blocks: jts.Stacked[Block]) -> int:
        return blocks.w.shape[0]

    assert count(_stack(jax.random.key(0), 3)) == 3
    with pytest.raises(CHECK_ERRORS):
        count("not a block")


def test_two_dims_and_nested_stacks(mesh):
    deep = jts.sharded_init(Deep, jax.random.key(0), mesh=mesh)
    assert deep.blocks.w.shape == (2, 3, 8, 4)
    want = NamedSharding(mesh, P(None, None, None, "model"))
    assert deep.blocks.w.sharding.is_equivalent_to(want, 4)
    summary = jts.check_tree(deep, summary=True)
    assert summary.checked == 1 and summary.unannotated == ("tree.blocks.scale",)
    outer = jts.sharded_init(Outer, jax.random.key(0), mesh=mesh)
    assert outer.stages.inner.w.shape == (4, 3, 8, 4)
    want = NamedSharding(mesh, P("data", None, None, "model"))
    assert outer.stages.inner.w.sharding.is_equivalent_to(want, 4)
    jts.check_tree(outer)
    spec = jts.shardings(outer, mesh).stages.inner.w.spec
    assert spec == P("data", None, None, "model")
    # One dim short (declared 2, the value has 1 stacked): a mismatch by path.
    short = eqx.tree_at(lambda m: m.blocks.w, deep, deep.blocks.w[0])
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.blocks\.w: rank 3"):
        jts.check_tree(short)


def test_declared_both_ways_names_the_leaf(mesh):
    deep = jts.sharded_init(Deep, jax.random.key(0), mesh=mesh)
    for call in (
        lambda: jts.check_tree(deep, stacked={"blocks/w": 2}),
        lambda: jts.shardings(deep, mesh, stacked={"blocks/w": 2}),
        lambda: jts.explain(deep, mesh, stacked={"blocks/w": 2}),
        lambda: jts.sharded_init(
            Deep, jax.random.key(0), mesh=mesh, stacked={"blocks/w": 2}
        ),
    ):
        with pytest.raises(jts.ShardingAnnotationError, match="`blocks/w`.*twice"):
            call()
    # Every leaf below the hint is declared by it, annotated or not.
    with pytest.raises(jts.ShardingAnnotationError, match="`blocks/scale`.*twice"):
        jts.check_tree(deep, stacked={"blocks/scale": 2})


def _placed(mesh):
    stack = _stack(jax.random.key(0), 3)
    w = jax.device_put(stack.w, NamedSharding(mesh, P(None, None, "model")))
    scale = jax.device_put(stack.scale, NamedSharding(mesh, P()))
    return eqx.tree_at(lambda b: (b.w, b.scale), stack, (w, scale))


def test_a_parameter_hint_declares_it_for_jit(mesh):
    stack = _placed(mesh)

    @jts.jit(in_shardings="annotations", out_shardings="annotations")
    def f(blocks: jts.Stacked[Block]) -> jts.Stacked[Block]:
        return blocks

    with jax.set_mesh(mesh):
        out = f(stack)
        want = NamedSharding(mesh, P(None, None, "model"))
        assert out.w.sharding.is_equivalent_to(want, 3)
        flat = jax.device_put(stack.w, NamedSharding(mesh, P()))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\.w"):
            f(eqx.tree_at(lambda b: b.w, stack, flat))
        checked = jts.jit(f.__wrapped__)
        checked(stack)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\.w"):
            checked(eqx.tree_at(lambda b: b.w, stack, flat))


def test_jit_keyword_matches_per_argument(mesh):
    stack = _placed(mesh)

    @jts.jit(stacked={"w": 1})  # x has no leaf `w`: not an error for jit
    def f(blocks: Block, x: Float[Array, "b e", P("data", None)]):
        return x * jnp.mean(blocks.w)

    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        f(stack, x)
    with pytest.raises(jts.ShardingAnnotationError, match="matches no leaf"):
        jts.check_tree(stack, stacked={"layers/**": 1})  # one tree: strict
