"""A quantised pure-JAX LLM (tests/quantised_model.py), checked on every leaf with
no annotation beyond its field hints (issue 34, item 3): a field hinted
`Float[Array, "embed mlp", jts.Logical] | QuantArray` walks a `QuantArray` value as
its own class, whose `jts.FollowsField` leaves follow the field's logical dims (a
scale only the dims it keeps), and a float value as the array member. Explicit and
Auto meshes; eager `check_tree`, `shardings` (agreeing with the codebase's own
plumbing), the `jts.jit` boundary through a warm cache, `jts.Tree[...]` under
beartype and typeguard; planted wrong layouts caught, each by key path."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from . import quantised_model as qm
from .helpers import CHECK_ERRORS, make_identity
from .quantised_model import QuantArray, Weights


LEAVES = 52  # 3 layers x (7 weights x 2 + 2 norms) + embedding, final norm, lm_head


@pytest.fixture
def mesh(mesh_4x2):
    """The plugin's 4x2 mesh, Explicit then Auto."""
    return mesh_4x2


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _scope(mesh):
    # The program's own rules dataclass, as its config holds it.
    return jax.set_mesh(mesh), jts.axis_rules(qm.RULES)


def _bugs(weights: Weights, mesh) -> list:
    """Wrong layouts: `(key path, where it goes, the wrong value, the spec the
    error must name)`, each at one key path."""
    l0, l1 = weights.layers[0], weights.layers[1]
    head = weights.lm_head
    assert isinstance(head, QuantArray)
    return [
        # A per-channel scale (1, mlp) replicated where it should follow mlp.
        (
            ".layers[1].mlp.gate.scale",
            lambda w: w.layers[1].mlp.gate.scale,
            _put(mesh, l1.mlp.gate.scale),
            "P(None, 'model')",
        ),
        # A quantised value on too few axes (q_heads replicated, not on model).
        (
            ".layers[0].attn.q.quant",
            lambda w: w.layers[0].attn.q.quant,
            _put(mesh, l0.attn.q.quant, "data", None, None),
            "P('data', 'model', None)",
        ),
        # A plain float weight where the field allows one, laid out wrong.
        (
            ".layers[2].mlp.down",
            lambda w: w.layers[2].mlp.down,
            _put(mesh, jnp.ones((8, 8)), "model"),
            "P('model', 'data')",
        ),
        # A dropped-dims scale, (vocab,), replicated where it should follow vocab.
        (
            ".lm_head.scale",
            lambda w: w.lm_head.scale,
            _put(mesh, head.scale, None),
            "P('model')",
        ),
    ]


def _planted(weights: Weights, mesh) -> tuple[Weights, dict]:
    """Every wrong layout of `_bugs` at once, and `{path: spec}`."""
    bad = weights
    for _, where, value, _ in _bugs(weights, mesh):
        bad = eqx.tree_at(where, bad, value)
    return bad, {path: want for path, _, _, want in _bugs(weights, mesh)}


def test_every_leaf_checked(mesh):
    weights = qm.build(mesh)
    assert qm.leaf_count(weights) == LEAVES
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        summary = jts.check_tree(weights, summary=True, strict=True)
        assert (summary.leaves, summary.checked, summary.unannotated) == (
            LEAVES,
            LEAVES,
            (),
        )


def test_shardings_agree_with_the_codebase(mesh):
    """`jts.shardings` (concrete and abstract) gives what the program's own
    plumbing placed, leaf for leaf: the quantised values the weight's spec, each
    scale the dims it keeps."""
    weights = qm.build(mesh)
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        for tree in (weights, jax.eval_shape(lambda: weights)):
            ours = jax.tree_util.tree_leaves(jts.shardings(tree))
            theirs = [x.sharding for x in jax.tree_util.tree_leaves(weights)]
            assert len(ours) == LEAVES
            for a, b in zip(ours, theirs):
                assert a.spec == b.spec and a.mesh == b.mesh
    up = weights.layers[0].mlp.up  # (embed, mlp) quantised along embed, dropped
    gate = weights.layers[0].mlp.gate  # kept: (1, mlp)
    assert up.scale.shape == (8,) and gate.scale.shape == (1, 8)
    assert up.scale.sharding.spec == P("model")
    assert gate.scale.sharding.spec == P(None, "model")


def test_sharded_init_abstract_and_explain(mesh):
    """The init function itself (no placement of its own): `sharded_init` lays
    each leaf out as the codebase would, `abstract` says so without computing,
    `explain` has a row for every leaf with its spec."""
    placed = [x.sharding.spec for x in jax.tree_util.tree_leaves(qm.build(mesh))]
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        made = jts.sharded_init(qm.build, None, mesh=mesh)
        shapes = jts.abstract(qm.build, None, mesh=mesh)
        rows = jts.explain(made).rows
    for tree in (made, shapes):
        specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(tree)]
        assert specs == placed
    assert len(rows) == LEAVES
    assert [r.spec for r in rows] == placed


def test_planted_layouts_caught_by_path(mesh):
    weights = qm.build(mesh)
    bad, expected = _planted(weights, mesh)
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        with pytest.raises(jts.ShardingTypeCheckError) as error:
            jts.check_tree(bad, name="weights")
    text = str(error.value)
    n = qm.leaf_count(bad)  # one fewer: a plain array stands for a QuantArray
    assert n == LEAVES - 1
    assert f"{len(expected)} of {n} checked leaves do not match" in text
    for path, want in expected.items():
        line = next(x for x in text.splitlines() if f"weights{path}:" in x)
        assert want in line, line
    assert error.value.summary.checked == n


def test_mixed_model_float_and_int8(mesh):
    """Some weights float, some int8: each field walks what it holds."""
    weights = qm.build(mesh, quantised=lambda name, layer: layer == 1)
    float_weights = 7 * 2  # two float layers, 7 weights each, one leaf apiece
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        summary = jts.check_tree(weights, summary=True, strict=True)
    assert summary.leaves == summary.checked == LEAVES - float_weights - 1
    assert isinstance(weights.layers[0].mlp.up, jax.Array)
    assert isinstance(weights.layers[1].mlp.up, QuantArray)


def test_optional_fields_absent(mesh):
    weights = qm.build(mesh)
    layers = [
        dataclasses.replace(x, mlp=dataclasses.replace(x.mlp, down=None))
        for x in weights.layers
    ]
    trimmed = dataclasses.replace(weights, layers=layers, lm_head=None)
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        summary = jts.check_tree(trimmed, summary=True, strict=True)
    assert summary.leaves == summary.checked == LEAVES - 3 * 2 - 2


@jts.jit
def _step(weights: Weights) -> jax.Array:
    return qm.total(weights)


def test_jit_boundary_warm_then_changed_layout(mesh):
    weights = qm.build(mesh)
    bad, expected = _planted(weights, mesh)
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        first = _step(weights)
        second = _step(weights)  # warm: JAX's cache
        assert jnp.allclose(first, second)
        with pytest.raises(jts.ShardingTypeCheckError) as error:
            _step(bad)
        _step(weights)  # and the good layout still passes after
    text = str(error.value)
    for path in expected:
        assert f"weights{path}" in text, path
    if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        n = qm.leaf_count(bad)
        assert f"{len(expected)} of {n} checked leaves do not match" in text


def test_jit_one_layout_changed_at_a_time(mesh):
    """Each planted layout alone, after a warm call: the cache does not hide it."""
    weights = qm.build(mesh)
    paths = [path for path, _, _, _ in _bugs(weights, mesh)]
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        _step(weights)
        for path, where, value, _ in _bugs(weights, mesh):
            with pytest.raises(jts.ShardingTypeCheckError) as error:
                _step(eqx.tree_at(where, weights, value))
            text = str(error.value)
            assert [p for p in paths if f"weights{p}" in text] == [path]
            _step(weights)


@pytest.mark.parametrize("checker", ["beartype", "typeguard"])
def test_tree_hint_of_a_union(mesh, checker):
    """`jts.Tree[A | QuantArray]` under beartype / typeguard: every leaf of
    either member checked, as the walk reads it."""
    weights = qm.build(mesh)
    hint = jts.Tree[qm.Mlp.__annotations__["up"]]
    f = make_identity(checker, hint, hint)
    up, gate = weights.layers[0].mlp.up, weights.layers[0].mlp.gate
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        assert f(up) is up and f(gate) is gate
        plain = _put(mesh, jnp.ones((8, 8)), "data", "model")
        assert f(plain) is plain
        for wrong, path in (
            (dataclasses.replace(gate, scale=_put(mesh, gate.scale)), "scale"),
            (dataclasses.replace(up, quant=_put(mesh, up.quant, "data")), "quant"),
            (_put(mesh, jnp.ones((8, 8)), "data"), None),
        ):
            with pytest.raises(CHECK_ERRORS + (jts.ShardingTypeCheckError,)) as error:
                f(wrong)
            texts, e = [], error.value
            while e is not None:  # beartype's reason is chained behind jaxtyping's
                texts.append(str(e))
                e = e.__cause__ or e.__context__
            reason = hint.__instancecheck_str__(wrong)
            if checker == "beartype":
                assert reason in "\n".join(texts)
            if path is not None:
                assert f"`.{path}`" in reason, reason
            want = "P(None, 'model')" if path == "scale" else "P('data', 'model')"
            assert want in reason, reason


def test_preflight_counts_every_quantised_leaf(mesh):
    """`preflight` of the step on the abstract model: every leaf annotated and
    counted with the spec the codebase placed it with, int8 values at a byte
    per element; a planted layout in the abstract tree is refused."""
    placed = [x.sharding.spec for x in jax.tree_util.tree_leaves(qm.build(mesh))]
    with jax.set_mesh(mesh), jts.axis_rules(qm.RULES):
        shapes = jts.abstract(qm.build, None, mesh=mesh)
        report = jts.preflight(_step, shapes, mesh=mesh)
        args = [x for x in report.leaves if x.group == "weights"]
        assert len(args) == LEAVES and all(x.annotated for x in args)
        assert [x.spec for x in args] == placed
        quant = next(x for x in args if x.path == "weights.layers[0].mlp.up.quant")
        assert quant.bytes_per_device == 8 * 8 // 8  # int8, 8-way sharded
        scale = shapes.layers[0].mlp.up.scale
        wrong = eqx.tree_at(
            lambda w: w.layers[0].mlp.up.scale,
            shapes,
            jax.ShapeDtypeStruct(scale.shape, scale.dtype, sharding=_put_spec(mesh)),
        )
        with pytest.raises(jts.ShardingTypeCheckError, match=r"mlp\.up\.scale"):
            jts.preflight(_step, wrong, mesh=mesh)


def _put_spec(mesh, *spec):
    return NamedSharding(mesh, P(*spec))
