"""Flax NNX: a Variable's `out_sharding` metadata is an annotation (issue 24)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


nnx = pytest.importorskip("flax.nnx")

RULES = {"embed": "data", "mlp": "model", "vocab": None}


class Mlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(
            init(rngs.params(), (8, 16)), out_sharding=("embed", "mlp")
        )
        self.w_out = nnx.Linear(
            16,
            8,
            kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
            rngs=rngs,
        )
        self.scale = nnx.Param(jnp.ones((8,)))  # no metadata: declares nothing


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Mlp(rngs) for _ in range(2)])
        # Mesh axes named directly, no rule needed (as Flax reads them).
        self.head = nnx.Param(jnp.zeros((8, 4)), out_sharding=("data", None))


def build():
    with nnx.use_eager_sharding(False):
        return Model(nnx.Rngs(0))


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


def _placed(model, mesh):
    with jts.axis_rules(RULES):
        return jax.device_put(model, jts.shardings(model, mesh=mesh))


def test_shardings_read_the_metadata(mesh):
    model = build()
    with jts.axis_rules(RULES):
        got = jts.shardings(model, mesh=mesh)
    assert got.blocks[1].w_in.get_value().spec == P("data", "model")
    assert got.blocks[0].w_out.kernel.get_value().spec == P("model", "data")
    assert got.head.get_value().spec == P("data", None)
    assert got.blocks[0].scale.get_value() is None  # no metadata: nothing declared
    assert got.blocks[0].w_out.bias.get_value() is None


def test_check_tree_passes_placed_and_names_the_misplaced_leaf(mesh):
    model = build()
    placed = _placed(model, mesh)
    with jts.axis_rules(RULES):
        jts.check_tree(placed)
        assert placed.blocks[1].w_in.get_value().sharding.spec == P("data", "model")
        # One parameter replicated: caught by its NNX path.
        w_in = placed.blocks[1].w_in
        w_in.set_value(jax.device_put(w_in.get_value(), NamedSharding(mesh, P())))
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(placed, name="model")
    text = str(info.value)
    assert "model.blocks[1].w_in.value" in text
    assert "P('data', 'model')" in text and "('embed', 'mlp')" in text
    assert "blocks[0]" not in text


def test_rules_change_between_calls(mesh):
    """Warm, change the rules, call again: the metadata is resolved each time."""
    placed = _placed(build(), mesh)
    with jts.axis_rules(RULES):
        jts.check_tree(placed)
    swapped = {"embed": "model", "mlp": "data", "vocab": None}
    with jts.axis_rules(swapped), pytest.raises(jts.ShardingTypeCheckError):
        jts.check_tree(placed)
    with jts.axis_rules(RULES):
        jts.check_tree(placed)


def test_no_metadata_and_no_rules_needed_for_mesh_axes(mesh):
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 4)), out_sharding=("model", "data"))
    got = jts.shardings(p, mesh=mesh)  # no rules in force at all
    assert got.get_value().spec == P("model", "data")


def test_unknown_name_says_how_flax_reads_it(mesh):
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 4)), out_sharding=("embd", "mlp"))
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(p, mesh=mesh)
    text = str(info.value)
    assert "'embd'" in text and "no such axis" in text
    assert "Flax would resolve it to P('embd', 'model')" in text


def test_two_dims_on_one_axis_says_how_flax_reads_it(mesh):
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 8)), out_sharding=("embed", "embed"))
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(p, mesh=mesh)
    assert "Flax would resolve it to P('data', 'data')" in str(info.value)


def test_replicated_metadata_is_replicated(mesh):
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 4)), out_sharding=(None, None))
    assert (
        jts.shardings(p, mesh=mesh)
        .get_value()
        .is_equivalent_to(NamedSharding(mesh, P()), 2)
    )


def test_deprecated_alias_is_read():
    mesh = MESHES["explicit"]()
    with nnx.use_eager_sharding(False), pytest.warns(DeprecationWarning):
        p = nnx.Param(jnp.zeros((8, 4)), sharding_names=("embed", None))
    with jts.axis_rules(RULES):
        assert jts.shardings(p, mesh=mesh).get_value().spec == P("data", None)


class Annotated(nnx.Module):
    w: Float[Array, "embed mlp", jts.Logical]
    v: Float[Array, "a b", P("data", None)]

    def __init__(self, w_meta, v_meta):
        with nnx.use_eager_sharding(False):
            self.w = nnx.Param(jnp.zeros((8, 4)), out_sharding=w_meta)
            self.v = nnx.Param(jnp.zeros((8, 4)), out_sharding=v_meta)


def test_field_annotation_and_metadata_agree(mesh):
    m = Annotated(("embed", "mlp"), ("embed", None))  # 'embed' -> 'data'
    with jts.axis_rules(RULES):
        got = jts.shardings(m, mesh=mesh)
    assert got.w.get_value().spec == P("data", "model")
    assert got.v.get_value().spec == P("data", None)


def test_field_annotation_and_metadata_disagree(mesh):
    m = Annotated(("embed", "mlp"), ("mlp", None))
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(m, mesh=mesh)
    text = str(info.value)
    assert "model.v" in text and "P('data', None)" in text
    assert "out_sharding=('mlp', None)" in text and "disagree" in text
    # The same error at the first check, not a silent pick of one of them.
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError):
        jts.check_tree(m)


def test_explicit_annotation_tree_wins_over_metadata(mesh):
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 4)), out_sharding=("embed", "mlp"))
    with jts.axis_rules(RULES):
        got = jts.shardings(p, mesh=mesh, annotations=P("model"))
    assert got.get_value().spec == P("model", None)


def test_explain_reads_the_metadata():
    mesh = MESHES["explicit"]()
    with jts.axis_rules(RULES):
        text = str(jts.explain(build(), mesh=mesh))
    assert "blocks[1].w_in.value" in text
    assert "float32[8@data,16@model]" in text
    assert "embed mlp" in text  # the logical names, from the metadata


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_preflight_counts_returned_variables_by_their_metadata(kind):
    # A step with no return hint returns the Variables: on an Auto mesh the trace
    # gives their layout no more than the hint does, and their metadata is it
    # (issue 33, item 5: they were "no sharding annotated", 0 bytes).
    pod = AbstractMesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    _, state = nnx.split(build())
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

    def step(state):
        return jax.tree.map(lambda x: 2 * x, state)

    with jts.axis_rules(RULES):
        report = jts.preflight(step, shapes, mesh=pod)
    out = {leaf.path: leaf for leaf in report.leaves if leaf.group == "outputs"}
    w_in = out["outputs['blocks'][1]['w_in'].value"]
    assert w_in.annotated and w_in.spec == P("data", "model")
    assert w_in.bytes_per_device == 2 * 8 * 4
    assert out["outputs['head'].value"].bytes_per_device == 2 * 4 * 4
    kernel = out["outputs['blocks'][0]['w_out']['kernel'].value"]
    assert kernel.spec == P("model", "data") and kernel.bytes_per_device == 64
    annotated = [leaf for leaf in out.values() if leaf.annotated]
    assert len(annotated) == 5 and not any(leaf in report.unknown for leaf in annotated)
    # Only the leaves with no metadata are left to XLA on Auto axes, by name.
    unknown = {leaf.path for leaf in report.unknown if leaf.group == "outputs"}
    if kind == AxisType.Auto:
        assert unknown == {p for p, leaf in out.items() if not leaf.annotated}
        assert "['scale'].value" in " ".join(report.checks.not_checked)
    else:
        assert not unknown
