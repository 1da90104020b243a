"""Flax Linen: `nn.LogicallyPartitioned` / `nn.Partitioned` boxes are annotations
(issue 34, item 1), on boxed trees and on unboxed states given their boxed tree."""

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES


nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

RULES = [("batch", "data"), ("vocab", "model"), ("embed", "data"), ("mlp", "model")]
LOGICAL = nn.with_logical_partitioning
INIT = nn.initializers.lecun_normal()


class Block(nn.Module):
    """MaxText's style: logical names on every kernel, a logical constraint."""

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        h = nn.Dense(16, kernel_init=LOGICAL(INIT, ("embed", "mlp")), use_bias=False)(x)
        h = nn.relu(h)
        return nn.Dense(
            8,
            kernel_init=LOGICAL(INIT, ("mlp", "embed")),
            bias_init=LOGICAL(nn.initializers.zeros, ("embed",)),
        )(h)


class Lm(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 8, embedding_init=LOGICAL(INIT, ("vocab", "embed")))
        x = Block()(embed(tokens))
        # Mesh axes written directly: `nn.Partitioned`, no rule involved.
        head = nn.Dense(
            32,
            kernel_init=nn.with_partitioning(INIT, ("data", "model")),
            use_bias=False,
        )
        return head(x)


TOKENS = jnp.zeros((8, 4), jnp.int32)
PATHS = {
    "['params']['Embed_0']['embedding'].value": P("model", "data"),
    "['params']['Block_0']['Dense_0']['kernel'].value": P("data", "model"),
    "['params']['Block_0']['Dense_1']['kernel'].value": P("model", "data"),
    "['params']['Block_0']['Dense_1']['bias'].value": P("data"),
    "['params']['Dense_0']['kernel'].value": P("data", "model"),
}


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


def boxed_shapes():
    return jax.eval_shape(Lm().init, jax.random.key(0), TOKENS)


def placed(mesh):
    with jts.axis_rules(RULES):
        return jax.device_put(
            Lm().init(jax.random.key(0), TOKENS), jts.shardings(boxed_shapes(), mesh)
        )


def _by_path(tree):
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in pairs}


def _misplace(tree, path, mesh):
    """`tree` with the leaf at `path` (keystr) replicated: a planted bug."""

    def one(p, leaf):
        if jax.tree_util.keystr(p) == path:
            return jax.device_put(leaf, NamedSharding(mesh, P()))
        return leaf

    return jax.tree_util.tree_map_with_path(one, tree)


def test_shardings_read_the_boxes(mesh):
    with jts.axis_rules(RULES):
        got = _by_path(jts.shardings(boxed_shapes(), mesh))
    assert {p: s.spec for p, s in got.items()} == PATHS


def test_boxed_params_checked_every_leaf(mesh):
    params = placed(mesh)
    with jts.axis_rules(RULES):
        summary = jts.check_tree(params, summary=True)
    assert summary.checked == summary.leaves == 5, summary


@pytest.mark.parametrize("path", sorted(PATHS))
def test_planted_bug_named_by_path(mesh, path):
    bad = _misplace(placed(mesh), path, mesh)
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(bad, name="params")
    text = str(info.value)
    assert "1 of 5 checked leaves" in text
    assert f"params{path}:" in text
    others = [p for p in PATHS if p != path]
    assert not any(f"params{p}:" in text for p in others)


def test_unboxed_state_given_its_boxed_tree(mesh):
    unboxed = nn.unbox(placed(mesh))
    path = "['params']['Block_0']['Dense_0']['kernel']"
    with jts.axis_rules(RULES):
        summary = jts.check_tree(unboxed, annotations=boxed_shapes(), summary=True)
        assert summary.checked == 5
        bad = _misplace(unboxed, path, mesh)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"1 of 5") as info:
            jts.check_tree(bad, annotations=boxed_shapes())
    assert f"tree{path}: this array is sharded as `float32[8,16]`" in str(info.value)
    # With no annotations, an unboxed state declares nothing: said, not a pass.
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingTypeCheckError):
        jts.check_tree(unboxed)


def test_flax_logical_spec_tree_as_logical_names(mesh):
    specs = nn.get_partition_spec(boxed_shapes())
    assert specs["params"]["Block_0"]["Dense_0"]["kernel"] == P("embed", "mlp")
    unboxed = nn.unbox(placed(mesh))
    annotations = jts.logical_specs(specs)
    # The head's box is `nn.Partitioned`: in the spec tree its mesh axes look
    # like logical names, so give its rule too (or leave it `None`).
    rules = [*RULES, ("data", "data"), ("model", "model")]
    with jts.axis_rules(rules):
        assert jts.check_tree(unboxed, annotations, summary=True).checked == 5
        path = "['params']['Embed_0']['embedding']"
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(_misplace(unboxed, path, mesh), annotations)
    assert f"tree{path}:" in str(info.value)
    assert "Linen logical spec P('vocab', 'embed')" in str(info.value)


def test_adam_state_of_boxed_params_is_read(mesh):
    params = placed(mesh)
    state = optax.adam(1e-3).init(params)
    with jts.axis_rules(RULES):
        summary = jts.check_tree(state, summary=True)
        assert summary.checked == 10  # mu and nu keep the boxes
        path = "[0].mu['params']['Dense_0']['kernel'].value"
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(_misplace(state, path, mesh), name="opt_state")
    assert f"opt_state{path}:" in str(info.value)
    assert "1 of 10" in str(info.value)


def test_jit_boundary_reads_the_boxes_through_the_cache(mesh):
    @jts.jit
    def step(params, scale):
        return jax.tree.map(lambda p: p * scale, params)

    params = placed(mesh)
    path = "['params']['Block_0']['Dense_1']['kernel'].value"
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        out = step(params, 2.0)  # warm
        assert out["params"]["Dense_0"]["kernel"].value.sharding.spec == P(
            "data", "model"
        )
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(_misplace(params, path, mesh), 2.0)
        assert f"params{path}" in str(info.value)
        step(params, 3.0)  # the right layout still passes

    # The result's boxes are annotations too: a step that loses a layout is
    # caught at its return, by path.
    @jts.jit
    def lossy(params):
        return jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)

    if mesh.axis_types[0] == AxisType.Explicit:
        with jax.set_mesh(mesh), jts.axis_rules(RULES):
            with pytest.raises(jts.ShardingTypeCheckError) as info:
                lossy(params)
        assert "return['params']['Embed_0']['embedding'].value" in str(info.value)


def test_box_rules_of_its_own_win(mesh):
    # `with_logical_partitioning(rules=...)`: Linen's unbox reads those.
    own = LOGICAL(INIT, ("embed", "mlp"), rules=(("embed", "model"), ("mlp", None)))
    dense = nn.Dense(16, kernel_init=own, use_bias=False)
    shapes = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((2, 8)))
    with jts.axis_rules(RULES):
        got = jts.shardings(shapes, mesh)
    assert got["params"]["kernel"].value.spec == P("model", None)


def test_no_rules_says_what_linen_would_give():
    mesh = MESHES["explicit"]()
    with pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(boxed_shapes(), mesh)
    text = str(info.value)
    assert "no axis rules are in force" in text
    assert "Linen would give P(None, None) here" in text
    with pytest.raises(jts.ShardingAnnotationError) as info:  # the leaf first
        jts.check_tree(Lm().init(jax.random.key(0), TOKENS), name="params")
    assert str(info.value).startswith("params['params']['")
    assert "no axis rules are in force" in str(info.value)
    # Linen's own context is named, with the fix that passes the same table.
    with nn.logical_axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as e:
        jts.shardings(boxed_shapes(), mesh)
    assert "nn.logical_axis_rules` context holds" in str(e.value)
    assert "jts.axis_rules(nn.get_logical_axis_rules())" in str(e.value)
    with nn.logical_axis_rules(RULES):
        got = jts.shardings(
            boxed_shapes(), mesh, axis_rules=nn.get_logical_axis_rules()
        )
    assert {p: s.spec for p, s in _by_path(got).items()} == PATHS


def test_a_name_with_no_rule_says_linen_replicates_it():
    mesh = MESHES["explicit"]()
    rules = [r for r in RULES if r[0] != "mlp"]
    with jts.axis_rules(rules), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(boxed_shapes(), mesh)
    text = str(info.value)
    assert "['params']['Block_0']['Dense_0']['kernel']" in text or "'mlp'" in text
    assert "no axis rule for logical name 'mlp'" in text
    assert "Linen would give P('data', None) here" in text


def test_sharded_init_and_abstract_of_a_linen_init(mesh):
    model = Lm()
    with jts.axis_rules(RULES):
        shapes = jts.abstract(model.init, jax.random.key(0), TOKENS, mesh=mesh)
        params = jts.sharded_init(model.init, jax.random.key(0), TOKENS, mesh=mesh)
        assert jts.check_tree(params, summary=True).checked == 5
    assert {p: s.sharding.spec for p, s in _by_path(shapes).items()} == PATHS
    assert {p: a.sharding.spec for p, a in _by_path(params).items()} == PATHS


def test_explain_reads_the_boxes():
    mesh = MESHES["explicit"]()
    with jts.axis_rules(RULES):
        text = str(jts.explain(boxed_shapes(), mesh=mesh))
    assert "['Block_0']['Dense_0']['kernel'].value" in text
    assert "float32[8@data,16@model]" in text
    assert "not annotated" not in text


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_preflight_counts_boxed_params(kind):
    pod = AbstractMesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    model = Lm()

    def step(params, tokens):
        if kind == AxisType.Auto:  # Explicit axes: Embed's gather needs more
            model.apply(params, tokens)
        return jax.tree.map(lambda p: 2 * p, params)

    tokens = jax.ShapeDtypeStruct((8, 4), jnp.int32)
    with jts.axis_rules(RULES):
        report = jts.preflight(step, boxed_shapes(), tokens, mesh=pod)
    inputs = {leaf.path: leaf for leaf in report.leaves if leaf.group != "outputs"}
    kernel = next(v for p, v in inputs.items() if "['Dense_0']['kernel']" in p)
    assert kernel.annotated and kernel.spec == P("data", "model")
    embedding = next(v for p, v in inputs.items() if "embedding" in p)
    assert embedding.bytes_per_device == 32 * 8 * 4 // 8
    outputs = [leaf for leaf in report.leaves if leaf.group == "outputs"]
    assert len(outputs) == 5 and all(leaf.annotated for leaf in outputs)


def test_a_raw_logical_spec_tree_says_how_to_mark_it():
    mesh = MESHES["explicit"]()
    specs = nn.get_partition_spec(boxed_shapes())
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.shardings(nn.unbox(boxed_shapes()), mesh, annotations=specs)
    assert "P('embed', 'mlp') names mesh axis 'embed'" in str(info.value)
    assert "jts.logical_specs(specs)" in str(info.value)


def test_boxed_annotations_leave_unboxed_leaves_undeclared(mesh):
    # adam's `count` is no box: in the boxed tree given as annotations it
    # declares nothing (counted so), while every moment is checked.
    tx = optax.adam(1e-3)
    plain = nn.unbox(placed(mesh))
    with jax.set_mesh(mesh):
        state = tx.init(plain)
    with jts.axis_rules(RULES):
        annotations = jax.eval_shape(tx.init, boxed_shapes())
        summary = jts.check_tree(state, annotations, summary=True)
        assert summary.checked == 10 and summary.unannotated == ("tree[0].count",)
        path = "[0].nu['params']['Embed_0']['embedding']"
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(_misplace(state, path, mesh), annotations)
    assert f"tree{path}:" in str(info.value)


def test_scanned_layers_name_their_stacked_dim(mesh):
    # nn.scan adds the stacked dim to each box's names (`metadata_params`).
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            k = LOGICAL(INIT, ("embed", "mlp"))
            return nn.Dense(8, kernel_init=k, use_bias=False)(x), None

    stack = nn.scan(
        Layer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=4,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x = jnp.ones((8, 8))
    boxed = jax.eval_shape(stack().init, jax.random.key(0), x, None)
    kernel = boxed["params"]["Dense_0"]["kernel"]
    assert kernel.names == ("layers", "embed", "mlp")
    rules = [("layers", None), ("embed", "data"), ("mlp", "model")]
    with jts.axis_rules(rules):
        got = jts.shardings(boxed, mesh)
        assert got["params"]["Dense_0"]["kernel"].value.spec == P(None, "data", "model")
        scalar = nn.LogicallyPartitioned(jnp.float32(1.0), ())
        assert jts.shardings({"s": scalar}, mesh)["s"].value.spec == P()


@pytest.mark.parametrize("hint", ["dict", "tree", "any"])
def test_a_hinted_parameter_passed_boxed_params(mesh, hint):
    hints = {"dict": dict[str, Any], "tree": jts.Tree[dict], "any": Any}

    def step(params, scale):
        return jax.tree.map(lambda p: p * scale, params)

    step.__annotations__ = {"params": hints[hint]}
    jitted = jts.jit(step)
    params = placed(mesh)
    path = "['params']['Embed_0']['embedding'].value"
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        jitted(params, 2.0)
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jitted(_misplace(params, path, mesh), 2.0)
    assert f"params{path}" in str(info.value)
