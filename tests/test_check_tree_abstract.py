"""`check_tree` on trees of `jax.ShapeDtypeStruct` (what `jts.abstract` and
`jax.eval_shape` give, what a checkpoint is restored into): dtype and dims as
jaxtyping checks an array's, the `sharding` as a concrete array's."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import MESHES


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


class Dense(eqx.Module):
    weight: Float[Array, "embed mlp", P("data", "model")]
    bias: Float[Array, "mlp@model"]  # noqa: F821
    steps: Int[Array, ""]

    def __init__(self, key, embed=16, mlp=8):
        self.weight = jax.random.normal(key, (embed, mlp))
        self.bias = jnp.zeros((mlp,))
        self.steps = jnp.zeros((), jnp.int32)


def _sds(shape, dtype, mesh, spec):
    sharding = None if spec is None else NamedSharding(mesh, spec)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _with(tree, **fields):
    return eqx.tree_at(
        lambda m: [getattr(m, k) for k in fields], tree, list(fields.values())
    )


def test_the_abstract_tree_passes(mesh):
    tree = jts.abstract(Dense, jax.random.key(0), mesh=mesh)
    assert isinstance(tree.weight, jax.ShapeDtypeStruct)
    assert jts.check_tree(tree, name="target") is tree


def test_a_mis_sharded_leaf_is_named_by_path(mesh):
    tree = jts.abstract(Dense, jax.random.key(0), mesh=mesh)
    wrong = _with(
        tree,
        weight=_sds((16, 8), jnp.float32, mesh, P("model", "data")),
        bias=_sds((8,), jnp.float32, mesh, P()),
    )
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(wrong, name="target")
    text = str(info.value)
    assert "2 of 3 checked leaves" in text
    assert "target.weight: this array is sharded as `float32[16@model,8@data]`" in text
    assert "target.bias:" in text and "`float32[8]`" in text
    assert "target.steps" not in text


def test_dtype_and_dims_are_checked(mesh):
    tree = jts.abstract(Dense, jax.random.key(0), mesh=mesh)
    for field, value, words in (
        ("weight", _sds((16, 8), jnp.int32, mesh, P("data", "model")), "dtype int32"),
        ("weight", _sds((16,), jnp.float32, mesh, P("data")), "dim"),
        ("steps", _sds((), jnp.float32, mesh, P()), "dtype float32"),
    ):
        with pytest.raises(jts.ShardingTypeCheckError, match=f"target.{field}: "):
            try:
                jts.check_tree(_with(tree, **{field: value}), name="target")
            except jts.ShardingTypeCheckError as error:
                assert words in str(error)
                raise


def test_a_leaf_without_sharding_is_named():
    # jax.eval_shape reports no sharding on Auto meshes (jax#19656): such a
    # target cannot be compared, and says so, rather than passing.
    mesh = make_mesh((4, 2), ("data", "model"), "auto")
    tree = jts.abstract(Dense, jax.random.key(0), mesh=mesh)
    bare = _with(tree, weight=jax.ShapeDtypeStruct((16, 8), jnp.float32))
    with pytest.raises(jts.ShardingTypeCheckError, match="has no sharding") as info:
        jts.check_tree(bare, name="target")
    assert "target.weight" in str(info.value) and "jts.abstract" in str(info.value)
    # A leaf whose annotation asks for no sharding needs none.
    assert jts.check_tree(_with(tree, steps=jax.ShapeDtypeStruct((), jnp.int32)))


def test_like_between_arrays_and_their_abstract_tree(mesh):
    params = jts.sharded_init(Dense, jax.random.key(0), mesh=mesh)
    tree = jts.abstract(Dense, jax.random.key(0), mesh=mesh)
    jts.check_tree(tree, like=params)
    jts.check_tree(params, like=tree)
    wrong = _with(tree, bias=_sds((8,), jnp.float32, mesh, P()))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"restored\.bias"):
        jts.check_tree(wrong, like=params, name="restored")


def test_logical_annotations_under_rules():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), "explicit")

    class Logical(eqx.Module):
        w: Float[Array, "embed mlp", jts.Logical]

    good = Logical(_sds((16, 8), jnp.float32, mesh, P("fsdp", "tensor")))
    with jts.axis_rules({"embed": "fsdp", "mlp": "tensor"}):
        jts.check_tree(good)
    with jts.axis_rules({"embed": None, "mlp": "fsdp"}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.w"):
            jts.check_tree(good)


def test_stacked_abstract_layers(mesh):
    class Layer(eqx.Module):
        w: Float[Array, "embed mlp", P(None, "model")]

        def __init__(self, key):
            self.w = jax.random.normal(key, (8, 4))

    def stack(key):
        return eqx.filter_vmap(Layer)(jax.random.split(key, 4))

    tree = jts.abstract(stack, jax.random.key(0), mesh=mesh, stacked={"w": ("data",)})
    assert tree.w.shape == (4, 8, 4)
    jts.check_tree(tree, stacked={"w": ("data",)})
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.w"):
        jts.check_tree(tree, stacked={"w": 1})  # one unsharded leading dim


def test_a_union_passes_if_one_member_does(mesh):
    class Either(eqx.Module):
        v: Float[Array, "e", P("data")] | Float[Array, "e", P()]  # noqa: F821

    for spec in (P("data"), P()):
        jts.check_tree(Either(_sds((8,), jnp.float32, mesh, spec)))
    for leaf in (
        _sds((8,), jnp.float32, mesh, P("model")),
        _sds((8,), jnp.int32, mesh, P()),
    ):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.v"):
            jts.check_tree(Either(leaf))
