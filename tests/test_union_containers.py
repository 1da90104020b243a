"""A union of an array annotation and a pytree class (issue 34, item 3): a container
value is walked as its own class (its fields' annotations), never against the
array member; an array value as the array member. `jts.FollowsField` leaves take
the field's layout, dims lined up from the right, a dim of size 1 replicated;
with no sharded array member to follow they declare nothing, and say so."""

import dataclasses
from typing import NamedTuple, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int8


W = Float[Array, "e m", P("data", "model")]
RULES = {"embed": "data", "mlp": "model"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quant:
    value: Int8[Array, "...", jts.FollowsField]
    scale: Float[Array, "...", jts.FollowsField]


class QuantModule(eqx.Module):
    value: Int8[Array, "...", jts.FollowsField]
    scale: Float[Array, "...", jts.FollowsField]


class QuantTuple(NamedTuple):
    value: Int8[Array, "...", jts.FollowsField]
    scale: Float[Array, "...", jts.FollowsField]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OwnLayout:
    """A container whose fields say their own layout: walked as its class."""

    value: Int8[Array, "e m", P("data", None)]
    scale: Float[Array, "...", P()]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: W | Quant
    maybe: Optional[Union[W, QuantModule]]
    three: W | QuantTuple | None
    own: W | OwnLayout
    logical: Float[Array, "embed mlp", jts.Logical] | Quant
    either: (
        Float[Array, "e m", P("data", None)]
        | Float[Array, "e m", P(None, "model")]
        | Quant
    )
    bare: Optional[Quant]  # no array member: nothing to follow


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _quant(mesh, cls, value_spec, scale_shape, scale_spec):
    return cls(
        _put(mesh, jnp.ones((8, 4), jnp.int8), *value_spec),
        _put(mesh, jnp.ones(scale_shape), *scale_spec),
    )


def _layer(mesh) -> Layer:
    dm = ("data", "model")
    return Layer(
        w=_quant(mesh, Quant, dm, (1, 4), (None, "model")),
        maybe=_quant(mesh, QuantModule, dm, (4,), ("model",)),
        three=_quant(mesh, QuantTuple, dm, (8, 1), ("data",)),
        own=_quant(mesh, OwnLayout, ("data",), (4,), ()),
        logical=_quant(mesh, Quant, dm, (4,), ("model",)),
        either=_quant(mesh, Quant, ("data",), (4,), ()),
        bare=_quant(mesh, Quant, (), (4,), ()),
    )


@pytest.fixture
def mesh(mesh_4x2):
    """The plugin's 4x2 mesh, Explicit then Auto."""
    return mesh_4x2


def test_containers_walked_as_their_class(mesh):
    layer = _layer(mesh)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        summary = jts.check_tree(layer, summary=True, name="layer")
    assert summary.leaves == summary.checked == 14
    # `bare` has no sharded array member to follow: named, never a pass.
    assert summary.unannotated == ("layer.bare.value", "layer.bare.scale")
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        with pytest.raises(jts.ShardingTypeCheckError, match="bare.value"):
            jts.check_tree(layer, strict=True, name="layer")


def test_array_values_checked_as_the_array_member(mesh):
    layer = _layer(mesh)
    good = _put(mesh, jnp.ones((8, 4)), "data", "model")
    arrays = dataclasses.replace(
        layer, w=good, maybe=good, three=None, own=good, logical=good
    )
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        summary = jts.check_tree(arrays, summary=True)
        assert summary.leaves == summary.checked == 8  # either, bare: Quants
        wrong = dataclasses.replace(arrays, maybe=_put(mesh, jnp.ones((8, 4)), "data"))
        with pytest.raises(jts.ShardingTypeCheckError) as error:
            jts.check_tree(wrong, name="layer")
    assert "1 of 8 checked leaves" in str(error.value)
    assert "layer.maybe: this array is sharded as `float32[8@data,4]`" in str(
        error.value
    )


def test_shardings_follow_the_field(mesh):
    layer = _layer(mesh)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        out = jts.shardings(dataclasses.replace(layer, either=None))
    assert out.w.value.spec == P("data", "model")
    assert out.w.scale.spec == P(None, "model")  # (1, m): dim 0 of size 1
    assert out.maybe.scale.spec == P("model")  # (m,): lined up with `m`
    assert out.three.scale.spec == P("data", None)  # (e, 1): dim 1 of size 1
    assert out.own.value.spec == P("data", None) and out.own.scale.spec == P(None)
    assert out.logical.value.spec == P("data", "model")
    assert out.logical.scale.spec == P("model")
    assert out.bare.value is None and out.bare.scale is None
    assert out.either is None  # left out above: see the next test


def test_two_sharded_members_name_no_single_layout(mesh):
    """`A | B | Quant` with two layouts: each leaf is checked against either
    (as an array under `A | B` is), and `shardings` says it names no one."""
    layer = _layer(mesh)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        with pytest.raises(jts.ShardingAnnotationError, match="several shardings"):
            jts.shardings(layer)
        cols = _quant(mesh, Quant, (None, "model"), (4,), ("model",))
        summary = jts.check_tree(dataclasses.replace(layer, either=cols), summary=True)
    assert summary.checked == 14


@pytest.mark.parametrize(
    "field, value, scale, path, want",
    [
        ("w", ("data", "model"), (), "w.scale", "P(None, 'model')"),
        ("w", ("model", "data"), (None, "model"), "w.value", "P('data', 'model')"),
        ("maybe", ("data", "model"), (), "maybe.scale", "P('model')"),
        ("three", ("data",), ("data",), "three.value", "P('data', 'model')"),
        ("logical", ("data", "model"), (), "logical.scale", "P('model')"),
        ("own", ("data", "model"), (), "own.value", "P('data', None)"),
        ("either", ("model",), (), "either.value", "P('data')"),
    ],
)
def test_planted_layouts_caught_by_path(mesh, field, value, scale, path, want):
    layer = _layer(mesh)
    good = getattr(layer, field)
    shape = good.scale.shape
    bad = type(good)(
        _put(mesh, good.value, *value), _put(mesh, good.scale, *scale[: len(shape)])
    )
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        with pytest.raises(jts.ShardingTypeCheckError) as error:
            jts.check_tree(dataclasses.replace(layer, **{field: bad}), name="layer")
    text = str(error.value)
    assert "1 of 14 checked leaves" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("layer."))
    assert line.strip().startswith(f"layer.{path}:") and want in line, line


def test_jit_warm_then_changed_layout(mesh):
    layer = _layer(mesh)

    @jts.jit
    def step(layer: Layer) -> Float[Array, ""]:
        return jnp.sum(layer.w.value) + jnp.sum(layer.maybe.scale)

    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        step(layer)
        step(layer)
        moved = dataclasses.replace(
            layer, maybe=QuantModule(layer.maybe.value, _put(mesh, layer.maybe.scale))
        )
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.maybe\.scale"):
            step(moved)
        step(layer)


def test_stacked_layers_follow_after_the_stack(mesh):
    """A stack of quantised weights: the stacked dim leads, the scale (n, 1, m)
    lines up with the field's dims after it."""
    stack = Quant(
        _put(mesh, jnp.ones((2, 8, 4), jnp.int8), None, "data", "model"),
        _put(mesh, jnp.ones((2, 1, 4)), None, None, "model"),
    )
    tree = {"w": stack}
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        hint = {"w": W | Quant}
        summary = jts.check_tree(tree, hint, summary=True, stacked={"w/*": 1})
        assert summary.checked == 2
        out = jts.shardings(tree, annotations=hint, stacked={"w/*": 1})
        assert out["w"].scale.spec == P(None, None, "model")
        wrong = {"w": Quant(stack.value, _put(mesh, stack.scale))}
        with pytest.raises(jts.ShardingTypeCheckError, match=r"\['w'\]\.scale"):
            jts.check_tree(wrong, hint, stacked={"w/*": 1})


def test_written_alone_it_declares_nothing():
    A = Int8[Array, "...", jts.FollowsField]
    assert isinstance(jnp.ones((2,), jnp.int8), A)
    assert not isinstance(jnp.ones((2,)), A)  # jaxtyping's dtype check stands
    assert not hasattr(A, "_jts")  # no sharding of its own
    assert repr(jts.FollowsField) == "FollowsField"
    summary = jts.check_tree(
        Quant(jnp.ones((2,), jnp.int8), jnp.ones(())),
        summary=True,
        may_check_nothing=True,
    )
    assert summary.unannotated == ("tree.value", "tree.scale")
    with pytest.raises(jts.ShardingAnnotationError, match="gives the sharding twice"):
        Int8[Array, "e@data", jts.FollowsField]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TwoLayouts:
    w: Float[Array, "e m", P("data", None)] | Float[Array, "e m", P(None, "model")]


@jts.jit
def _sum(layer: TwoLayouts) -> Float[Array, ""]:
    return jnp.sum(layer.w)


def test_a_union_field_under_jit_knows_all_its_members(mesh):
    """A leaf under `A | B` in a tree, checked by the jit boundary: on Auto axes
    each member's verdict waits for XLA, and passes if any member matches
    (it once failed on the first member XLA's layout did not match)."""
    with jax.set_mesh(mesh):
        for spec in (("data",), (None, "model"), ("data",)):
            _sum(TwoLayouts(_put(mesh, jnp.ones((8, 4)), *spec)))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.w"):
            _sum(TwoLayouts(_put(mesh, jnp.ones((8, 4)), "model")))
        _sum(TwoLayouts(_put(mesh, jnp.ones((8, 4)), None, "model")))


def test_typed_shard_map_reads_the_followed_layout(mesh):
    """`typed_shard_map`'s in_specs come from the walk too: the scale (1, m) is
    split over `model` only; a replicated one is refused before shard_map
    would move it."""

    @jts.typed_shard_map(mesh=mesh)
    def dequantize(layer: Layer) -> Float[Array, "e m", P("data", "model")]:
        return layer.w.value.astype(jnp.float32) * layer.w.scale

    layer = dataclasses.replace(_layer(mesh), either=None)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        # `bare`'s leaves follow nothing: no spec, said by path.
        with pytest.raises(jts.ShardingAnnotationError, match=r"\.bare\.value"):
            dequantize(layer)
        layer = dataclasses.replace(layer, bare=None)
        for f in (dequantize, jax.jit(dequantize)):
            assert f(layer).sharding.spec == P("data", "model")
        w = Quant(layer.w.value, _put(mesh, layer.w.scale))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`layer\.w\.scale`"):
            dequantize(dataclasses.replace(layer, w=w))
