"""The one tree walk: leaves, key paths and the annotation of each.

This file uses `from __future__ import annotations`: every field annotation below
is a string, read back with `typing.get_type_hints`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, PyTree

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._trees import paths as _paths, walk as _tree


W = Float[Array, "e m", P(None, "model")]
B = Float[Array, "m@model"]
Norm = Float[Array, "e"]
W_NAME = W.__name__
B_NAME = B.__name__


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mlp:
    w_in: W
    b: Optional[B]
    act: str = dataclasses.field(metadata=dict(static=True), default="relu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    blocks: list[Mlp]
    emb: list[Float[Array, "v e", P("data")]]
    norms: dict[str, Norm]
    pair: tuple[W, B]


class State(NamedTuple):
    step: int
    mu: dict[str, Float[Array, "e m", P("data")]]


def model(n=2):
    mlp = lambda: Mlp(jnp.zeros((4, 6)), jnp.zeros(6))
    return Model(
        [mlp() for _ in range(n)],
        [jnp.zeros((8, 4))] * 2,
        {"a": jnp.zeros(4)},
        (jnp.zeros((4, 6)), jnp.zeros(6)),
    )


def same(annotation):
    # Each subscription makes a new class: compare annotations by name.
    return getattr(annotation, "__name__", annotation)


def names(leaves, name="model"):
    return {_paths.path_name(name, leaf.path): same(leaf.annotation) for leaf in leaves}


def test_fields_lists_dicts_tuples():
    got = names(_tree.walk(model()))
    assert got == {
        "model.blocks[0].w_in": W_NAME,
        "model.blocks[0].b": B_NAME,
        "model.blocks[1].w_in": W_NAME,
        "model.blocks[1].b": B_NAME,
        "model.emb[0]": same(Float[Array, "v e", P("data")]),
        "model.emb[1]": same(Float[Array, "v e", P("data")]),
        "model.norms['a']": same(Float[Array, "e"]),
        "model.pair[0]": W_NAME,
        "model.pair[1]": B_NAME,
    }


def test_leaves_in_flatten_order_and_none_fields_skipped():
    m = model()
    m.blocks[1].b = None
    leaves = _tree.walk(m)
    assert [x.value for x in leaves] == jax.tree_util.tree_leaves(m)
    assert "model.blocks[1].b" not in names(leaves)


def test_namedtuple_and_type_hint_annotations():
    state = State(3, {"w": jnp.zeros((4, 6))})
    got = names(_tree.walk(state), "state")
    assert got == {
        "state.step": None,
        "state.mu['w']": same(Float[Array, "e m", P("data")]),
    }
    # A type hint for a plain container: every value of the dict.
    tree = {"x": jnp.zeros((4, 6)), "y": jnp.zeros((2, 2))}
    got = names(_tree.walk(tree, dict[str, W]), "p")
    assert got == {"p['x']": W_NAME, "p['y']": W_NAME}
    got = names(_tree.walk([tree], PyTree[W]), "p")
    assert set(got.values()) == {W_NAME}


def test_annotation_tree_prefix():
    m = model()
    ann = {"blocks": P("data"), "emb": None, "norms": {"a": P()}, "pair": None}
    got = names(_tree.walk(m, ann))
    # A sharding in the tree covers its subtree and wins over the fields.
    assert got["model.blocks[0].w_in"] == P("data")
    assert got["model.blocks[1].b"] == P("data")
    assert got["model.norms['a']"] == P()
    # `None` in the tree: the field annotations apply.
    assert got["model.emb[0]"] == same(Float[Array, "v e", P("data")])
    assert got["model.pair[1]"] == B_NAME


def test_annotation_tree_of_the_same_type():
    m = model(1)
    ann = jax.tree.map(lambda _: P("data"), m)
    assert set(names(_tree.walk(m, ann)).values()) == {P("data")}


def test_annotation_tree_not_a_prefix():
    tree = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    with pytest.raises(jts.ShardingAnnotationError, match=r"value has key `\['b'\]`"):
        _tree.walk(tree, {"a": P()})
    with pytest.raises(jts.ShardingAnnotationError, match=r"`\['c'\]`, which the va"):
        _tree.walk(tree, {"a": P(), "b": P(), "c": P()})
    with pytest.raises(jts.ShardingAnnotationError, match="value is a leaf"):
        _tree.walk(tree, {"a": {"x": P()}, "b": None})
    with pytest.raises(jts.ShardingAnnotationError, match="used twice"):
        _tree.walk(tree, {"a": P("x", "x"), "b": None})
    with pytest.raises(jts.ShardingAnnotationError, match="is not an annotation"):
        _tree.walk(tree, rules={"a": "data"})


def test_rules():
    m = model()
    rules = {"blocks/*/w_in": P("data"), "**/b": NamedSharding, "emb/**": None}
    rules["**/b"] = Float[Array, "m", P()]
    got = names(_tree.walk(m, rules=rules))
    assert got["model.blocks[1].w_in"] == P("data")
    assert got["model.blocks[0].b"] == same(Float[Array, "m", P()])
    assert got["model.pair[1]"] == B_NAME  # `**/b` matches keys named b, not index 1
    assert got["model.emb[0]"] is None  # unannotated on purpose
    assert got["model.norms['a']"] == same(Float[Array, "e"])


def test_rule_paths_and_pattern_syntax():
    m = model()
    paths = [_paths.rule_path(x.path) for x in _tree.walk(m)]
    assert paths[:2] == ["blocks/0/w_in", "blocks/0/b"]
    assert "norms/a" in paths
    got = names(_tree.walk(m, rules={"**": P()}))
    assert set(got.values()) == {P()}
    got = names(_tree.walk(m, rules={"blocks/?/w_*": P("data")}))
    assert got["model.blocks[1].w_in"] == P("data")


def test_rules_are_strict():
    m = model()
    with pytest.raises(
        jts.ShardingAnnotationError, match="'blocks/\\*/w_out'.*match no"
    ):
        _tree.walk(m, rules={"blocks/*/w_out": P()})
    with pytest.raises(jts.ShardingAnnotationError, match="blocks/0/w_in.*matched by"):
        _tree.walk(m, rules={"blocks/*/w_in": P(), "**/w_in": P()})
    with pytest.raises(jts.ShardingAnnotationError, match="mapping"):
        _tree.walk(m, rules=[("a", P())])
    with pytest.raises(jts.ShardingAnnotationError, match="non-empty string"):
        _tree.walk(m, rules={"": P()})


def test_plans_are_cached_per_structure():
    m = model()
    _, plan = _tree.plan_for(m)
    _, again = _tree.plan_for(model())
    assert again is plan
    _, other = _tree.plan_for(model(3))
    assert other is not plan and len(other.paths) == len(plan.paths) + 2
    # Annotations and rules are part of the key.
    _, ruled = _tree.plan_for(m, rules={"**": P()})
    assert ruled is not plan and set(ruled.annotations) == {P()}
    _, given = _tree.plan_for(
        m, {"blocks": P(), "emb": None, "norms": None, "pair": None}
    )
    assert given.annotations[0] == P()


class Late:
    pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Unresolvable:
    x: NotDefinedAnywhere  # noqa: F821
    w: W


def test_an_unresolvable_field_annotation_declares_nothing_and_is_named():
    # One field that cannot be read: the other is still read, and the class is
    # named once, in a warning (see tests/test_unread_hints.py for the class).
    value = Unresolvable(jnp.zeros(2), jnp.zeros((4, 6)))
    with pytest.warns(jts.ShardingWarning, match="field `x` of .*Unresolvable"):
        leaves = _tree.walk(value)
    assert [leaf.annotation for leaf in leaves] == [None, W]
    assert "NotDefinedAnywhere" in leaves[0].note
