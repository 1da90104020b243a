"""check_tree: every leaf checked, one error listing each mismatch by key path."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float, typed_shard_map

from .helpers import no_transfers, place


Row = Float[Array, "b@data e"]
Col = Float[Array, "e m@model"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    w_in: Col
    w_out: Float[Array, "m e", P("model", None)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    blocks: list[Block]
    emb: Row


def make(mesh, wrong=()):
    """A model; the leaves named in `wrong` are replicated instead."""

    def put(name, shape, spec):
        return place(mesh, shape, P() if name in wrong else spec)

    blocks = [
        Block(
            put(f"w_in{i}", (4, 8), P(None, "model")),
            put(f"w_out{i}", (8, 4), P("model")),
        )
        for i in range(2)
    ]
    return Model(blocks, put("emb", (8, 4), P("data")))


def test_match_and_every_mismatch_listed(mesh_4x2):
    good = make(mesh_4x2)
    assert jts.check_tree(good, name="model") is good
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(make(mesh_4x2, {"w_in1", "emb"}), name="model")
    text = str(info.value)
    assert text.startswith("check_tree(model): 2 of 5 checked leaves do not match")
    assert "model.blocks[1].w_in: this array is sharded as `float32[4,8]`, not " in text
    assert "`e m@model`" in text
    assert "model.emb: this array is sharded as `float32[8,4]`" in text
    assert "'data': 4, 'model': 2" in text
    assert "model.blocks[0]" not in text and "w_out" not in text
    assert text.count("If the array is right") == 1  # the fix, said once
    assert isinstance(info.value, jax.errors.JaxRuntimeError) is False


def test_every_leaf_never_a_sample(mesh_explicit):
    # beartype checks one random element of a list; check_tree checks all.
    tree = [place(mesh_explicit, (8, 4), P("data")) for _ in range(40)]
    tree[37] = place(mesh_explicit, (8, 4), P())
    with pytest.raises(jts.ShardingTypeCheckError, match=r"(?s)1 of 40.*tree\[37\]"):
        jts.check_tree(tree, list[Row])
    tree[37] = place(mesh_explicit, (8, 4), P("data"))
    jts.check_tree(tree, list[Row])


def test_warm_caches_good_bad_good(mesh_4x2):
    good, bad = make(mesh_4x2), make(mesh_4x2, {"w_out0"})
    for _ in range(2):
        jts.check_tree(good)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree.blocks\[0\].w_out"):
            jts.check_tree(bad)


def test_no_transfers(mesh_4x2):
    good, bad = make(mesh_4x2), make(mesh_4x2, {"emb"})
    with no_transfers():
        jts.check_tree(good)
        with pytest.raises(jts.ShardingTypeCheckError):
            jts.check_tree(bad)


def test_annotations_and_rules(mesh_explicit):
    params = {"w": place(mesh_explicit, (8, 4), P("data")), "b": jnp.ones(4)}
    jts.check_tree(params, {"w": P("data"), "b": None}, name="params")
    jts.check_tree(params, rules={"w": Row, "b": P()}, name="params")
    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"params\['w'\]: .*P\('model'\)"
    ):
        jts.check_tree(params, {"w": P("model"), "b": None}, name="params")
    with pytest.raises(jts.ShardingAnnotationError, match="match no leaf"):
        jts.check_tree(params, rules={"x": P()})


def test_shape_and_dtype_too(mesh_explicit):
    tree = {"w": place(mesh_explicit, (8, 4), P("data"), dtype=jnp.int32)}
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['w'\]: .*dtype"):
        jts.check_tree(tree, {"w": Row})
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['w'\]"):
        jts.check_tree({"w": 3.0}, {"w": Row})


def test_inside_jit_explicit_at_trace_time(mesh_explicit):
    traces = []

    @jax.jit
    def step(model):
        traces.append(1)
        jts.check_tree(model, name="model")
        return model

    step(make(mesh_explicit))
    step(make(mesh_explicit))
    assert len(traces) == 1
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        step(make(mesh_explicit, {"w_in0", "w_out1"}))
    text = str(info.value)
    assert "2 of 5" in text and "traced array" in text
    assert "model.blocks[0].w_in" in text and "model.blocks[1].w_out" in text
    step(make(mesh_explicit))  # the good signature is still cached and fine


def test_inside_jit_auto_at_compile_time(mesh_auto):
    @jax.jit  # plain jax.jit: no boundary checks, only check_tree's
    def step(model):
        jts.check_tree(model, name="model")
        return model

    step(make(mesh_auto))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        step(make(mesh_auto, {"w_in1", "emb"}))
    text = str(info.value)
    assert "2 sharding mismatches while compiling" in text
    assert "model.blocks[1].w_in" in text and "model.emb" in text
    assert "XLA sharded it as `float32[4,8]`" in text and "Auto" in text
    step(make(mesh_auto))


def test_auto_with_plain_jit_and_sharding_errors(mesh_auto):
    step = jax.jit(lambda t: jts.check_tree(t, {"w": P("data")}, name="p"))
    with jts.sharding_errors():
        step({"w": place(mesh_auto, (8, 4), P("data"))})
    with pytest.raises(jts.ShardingTypeCheckError, match=r"p\['w'\]"):
        with jts.sharding_errors():
            step({"w": place(mesh_auto, (8, 4), P())})


def test_inside_shard_map(mesh_4x2):
    @typed_shard_map(mesh=mesh_4x2)
    def body(x: Row) -> Row:
        jts.check_tree({"x": x, "y": [x]}, {"x": Row, "y": [P("data")]}, name="t")
        return x

    jax.jit(body)(place(mesh_4x2, (8, 4), P("data")))

    @typed_shard_map(mesh=mesh_4x2)
    def wrong(x: Row) -> Row:
        jts.check_tree({"x": x, "y": [x]}, {"x": P(), "y": [P("model")]}, name="t")
        return x

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.jit(wrong)(place(mesh_4x2, (8, 4), P("data")))
    text = str(info.value)
    assert "2 of 2" in text and "t['x']" in text and "t['y'][0]" in text
    assert "inside shard_map" in text


def test_like(mesh_4x2):
    params = {"w": place(mesh_4x2, (8, 4), P("data")), "b": place(mesh_4x2, (4,), P())}
    grads = jax.tree.map(lambda x: x * 0, params)
    assert jts.check_tree(grads, like=params, name="grads") is grads
    bad = {"w": place(mesh_4x2, (8, 4), P()), "b": params["b"]}
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(bad, like=params, name="grads")
    assert "1 of 2" in str(info.value) and "grads['w']" in str(info.value)
    assert "P('data'" in str(info.value)
    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"`like` has no leaf at \['c'\]"
    ):
        jts.check_tree({**params, "c": params["b"]}, like=params)
    with pytest.raises(ValueError, match="not both"):
        jts.check_tree(grads, {"w": P()}, like=params)


def test_like_uses_annotations_first(mesh_explicit):
    wrong = make(mesh_explicit, {"emb"})
    # `like`'s annotations say P("data") for emb, whatever it holds.
    with pytest.raises(jts.ShardingTypeCheckError, match="tree.emb"):
        jts.check_tree(wrong, like=wrong)


def test_like_inside_jit(mesh_explicit, mesh_auto):
    def step(params, grads):
        jts.check_tree(grads, like=params, name="grads")
        return grads

    params = {"w": place(mesh_explicit, (8, 4), P("data"))}
    jax.jit(step)(params, params)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"grads\['w'\]"):
        jax.jit(step)(params, {"w": place(mesh_explicit, (8, 4), P())})
    auto = {"w": place(mesh_auto, (8, 4), P("data"))}
    with pytest.raises(jts.ShardingAnnotationError, match="not known until XLA"):
        jax.jit(step)(auto, auto)


def test_modes(mesh_explicit):
    bad = make(mesh_explicit, {"emb"})
    with jts.set_mode("warn"):
        with pytest.warns(jts.ShardingWarning, match="not `b@data e`"):
            jts.check_tree(bad)
    with jts.set_mode("off"), warnings.catch_warnings():
        warnings.simplefilter("error")
        jts.check_tree(bad)
    with pytest.raises(jts.ShardingTypeCheckError):
        jts.check_tree(bad)


def test_dims_bind_per_leaf_even_inside_jaxtyped(mesh_explicit):
    # Blocks of different widths, one dim name: each leaf is checked on its own,
    # and the enclosing function's own dims are left alone.
    tree = [place(mesh_explicit, (8, n), P("data")) for n in (2, 4)]

    @jaxtyped(typechecker=beartype)
    def f(x: Float[Array, "b e"]) -> Float[Array, "b e"]:
        jts.check_tree(tree, list[Row])
        return x

    f(jnp.ones((3, 5)))


def test_meshes_of_both_kinds_eagerly():
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
        jts.check_tree(make(mesh))
        with pytest.raises(jts.ShardingTypeCheckError, match="1 of 5"):
            jts.check_tree(make(mesh, {"w_out0"}))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Embedding:
    table: Float[Array, "vocab embed", jts.Logical]
    proj: Float[Array, "embed mlp", jts.Logical]


# `vocab` falls back to `model` where `data` (4) does not divide it (6 rows).
LOGICAL_RULES = {"vocab": ["data", "model"], "embed": None, "mlp": "model"}


def _embedding(mesh, table_spec=P("model", None)):
    return Embedding(
        place(mesh, (6, 4), table_spec), place(mesh, (4, 8), P(None, "model"))
    )


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_logical_annotations_resolve_with_the_rules_in_force(kind):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    params, bad = _embedding(mesh), _embedding(mesh, P())
    with jts.axis_rules(LOGICAL_RULES), no_transfers():
        assert jts.check_tree(params, name="params") is params
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(bad, name="params")
        jts.check_tree(params, name="params")  # warm plan, good again
    text = str(info.value)
    assert "1 of 2" in text and "params.table" in text and "params.proj" not in text
    assert "sharded as `float32[6,4]`" in text, text
    assert "not P('model', None) (from logical `vocab embed`" in text, text
    # Another table in force: the same tree now fails where it passed.
    with jts.axis_rules({**LOGICAL_RULES, "vocab": None}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"params\.table"):
            jts.check_tree(params, name="params")
        jts.check_tree(bad, name="params")
    with pytest.raises(jts.ShardingAnnotationError, match="rules"):
        jts.check_tree(params)  # no rules in force: no meaning, an error


def test_like_resolves_logical_annotations_with_shape_and_mesh(mesh_4x2):
    # `like`'s leaves are logical: each resolves with its own shape, so `vocab`
    # (6 rows) falls back to `model`, as a check of `params` itself says.
    params = _embedding(mesh_4x2)
    grads = jax.tree.map(lambda x: x * 0, params)
    wrong = dict(table=place(mesh_4x2, (6, 4), P()), proj=grads.proj)
    with jts.axis_rules(LOGICAL_RULES):
        jts.check_tree(params)
        assert jts.check_tree(grads, like=params, name="grads") is grads
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(wrong, like=params, name="grads")
    text = str(info.value)
    assert "1 of 2" in text and "grads['table']" in text, text
    assert "P('model', None)" in text, text
