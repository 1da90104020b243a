"""A stack's mesh axes are taken before its layer's dims resolve (issue 33,
item 4), on Explicit and Auto meshes.

- A stack on a mesh axis that the layer's own physical layout uses is the
  library's error, before compiling, on every path that resolves a stacked
  leaf, naming the leaf, the stack and the fix (JAX's `DuplicateSpecError`
  before).
- The rule for `jts.fsdp`: FSDP never splits the stacked dim, and a stack on
  FSDP's axis holds it, so the layer's FSDP dim falls back to replicated (as
  when another dim of the same array holds the axis); a single-candidate rule
  on the stack's axis is a conflict, named as one.
- `jts.as_used` reads a stacked leaf: its stack, then its layer as used.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


class Block(eqx.Module):
    w: Float[Array, "embed mlp", P(None, "model")]
    b: Float[Array, "mlp", P()]  # noqa: F821

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 4))
        self.b = jnp.zeros(4)


class Clash(eqx.Module):  # the stack on "model", which `w`'s own layout uses
    blocks: jts.Stacked[Block, ("model",)]  # noqa: F821

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, 2))


def _says_why(message, leaf):
    assert leaf in message, message
    assert "over mesh axis 'model'" in message
    assert "stacked dim 0 already holds (the stack P('model'))" in message
    assert (
        "stack over another mesh axis" in message and "replicate the stack" in message
    )
    assert "DuplicateSpec" not in message


def test_a_stack_on_the_layers_own_axis_is_refused_on_every_path(mesh):
    key = jax.random.key(0)
    value = jax.device_put(Clash(key), NamedSharding(mesh, P()))
    stacked = {"blocks/w": ("model",)}  # `stacked=` on a plain field: the same
    plain = {"blocks": value.blocks}

    @jts.jit
    def step(model: Clash) -> Clash:
        return model

    derived = jts.jit(step.__wrapped__, in_shardings="annotations")
    paths = {
        "sharded_init": (
            lambda: jts.sharded_init(Clash, key, mesh=mesh),
            "output.blocks.w",
        ),
        "abstract": (lambda: jts.abstract(Clash, key, mesh=mesh), "output.blocks.w"),
        "shardings": (lambda: jts.shardings(value, mesh=mesh), "tree.blocks.w"),
        "check_tree": (lambda: jts.check_tree(value), "tree.blocks.w"),
        "check_tree stacked=": (
            lambda: jts.check_tree(plain, stacked=stacked),
            "tree['blocks'].w",
        ),
        "like=": (lambda: jts.check_tree(value, like=value), "like.blocks.w"),
        "reshard": (lambda: jts.reshard(value), "x.blocks.w"),
        "explain": (lambda: jts.explain(value, mesh=mesh), "tree.blocks.w"),
        "jit boundary": (lambda: step(value), "model.blocks.w"),
        "jit in_shardings": (lambda: derived(value), "model.blocks.w"),
    }
    with jax.set_mesh(mesh):
        for what, (call, leaf) in paths.items():
            with pytest.raises(jts.ShardingAnnotationError) as info:
                call()
            _says_why(f"{what}: {info.value}", leaf)
    # b's layout uses no axis of the stack: not named.
    assert "blocks.b" not in str(info.value)


class Layer(eqx.Module):
    w: Float[Array, "embed mlp", jts.Logical]

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 4))


class Piped(eqx.Module):
    blocks: jts.Stacked[Layer, ("data",)]  # noqa: F821

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Layer)(jax.random.split(key, 4))


class Scanned(eqx.Module):
    blocks: jts.Stacked[Layer]

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Layer)(jax.random.split(key, 4))


FSDP = {"embed": jts.fsdp("data"), "mlp": "model"}


def test_fsdp_never_splits_the_stack_and_yields_to_its_axis(mesh):
    key = jax.random.key(0)
    with jts.axis_rules(FSDP), jax.set_mesh(mesh):
        piped = jts.sharded_init(Piped, key, mesh=mesh)
        scanned = jts.sharded_init(Scanned, key, mesh=mesh)
        # The stack holds "data": embed falls back; else embed takes it, never
        # the (replicated, divisible) stacked dim.
        assert piped.blocks.w.sharding.spec == P("data", None, "model")
        assert scanned.blocks.w.sharding.spec == P(None, "data", "model")
        assert jts.shardings(piped).blocks.w.spec == P("data", None, "model")
        assert jts.abstract(Piped, key, mesh=mesh).blocks.w.sharding.spec == P(
            "data", None, "model"
        )
        jts.check_tree(piped)
        jts.check_tree(scanned)
        # Planted: the scanned stack replicated is caught, by path.
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.blocks\.w"):
            jts.check_tree(jax.device_put(scanned, NamedSharding(mesh, P())))
        # as_used: the stack as declared, the layer's FSDP dim gathered.
        assert jts.as_used(piped).blocks.w.sharding.spec == P("data", None, "model")
        used = jts.as_used(scanned)
        assert used.blocks.w.sharding.spec == P(None, None, "model")
        assert jax.jit(jts.as_used)(scanned).blocks.w.sharding.is_equivalent_to(
            NamedSharding(mesh, P(None, None, "model")), 3
        )
        # The gathered tree is not the stored layout: not a silent pass.
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.blocks\.w"):
            jts.check_tree(used)


def test_a_rule_on_the_stacks_axis_is_a_conflict(mesh):
    key = jax.random.key(0)
    rules = {"embed": None, "mlp": "data"}  # one candidate, the stack's axis
    with jts.axis_rules(rules), jax.set_mesh(mesh):
        with pytest.raises(jts.ShardingAnnotationError) as info:
            jts.sharded_init(Piped, key, mesh=mesh)
        message = str(info.value)
        assert "output.blocks.w" in message and "dim 1 (`mlp`)" in message
        assert "'data' is taken by the leaf's stacked dim 0" in message
        assert "conflicts='first'" in message and "DuplicateSpec" not in message
    with jts.axis_rules(rules, conflicts="first"), jax.set_mesh(mesh):
        assert jts.sharded_init(Piped, key, mesh=mesh).blocks.w.sharding.spec == P(
            "data", None, None
        )
