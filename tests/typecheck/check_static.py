"""Checked by pyright (`pyright tests/typecheck`): the three-argument form is valid."""

import dataclasses
from typing import NamedTuple, Optional

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import (
    axis_rules,
    AxisRules,
    check_tree,
    Float,
    Int,
    Like,
    Shaped,
    Stacked,
    Tree,
    TreeSummary,
)


def layer(
    x: Float[Array, "batch embed", P("data", None)],
    w: Float[Array, "embed mlp", P(None, "model")],
    i: Int[Array, " batch"],
) -> Shaped[Array, "batch mlp", P("data", "model")]:
    return x @ w


def uses(x: jax.Array, w: jax.Array, i: jax.Array) -> jax.Array:
    return layer(x, w, i)


class Params:
    w: jax.Array


def apply(params: Tree[Params], x: jax.Array) -> jax.Array:
    return x @ params.w  # `Tree[Params]` reads as `Params`


def tree_of_dict(params: Tree[dict[str, jax.Array]]) -> jax.Array:
    return params["w"]


def checked_params(params: Params) -> Params:
    # `check_tree` returns the tree as its own type; with `summary=True`, a
    # `TreeSummary`.
    params = check_tree(params)
    counted: TreeSummary = check_tree(params, summary=True)
    assert counted.checked >= 0
    return params


def step(params: dict, opt_state: Like[" params"]) -> tuple[dict, Like[" params"]]:
    return params, opt_state  # `Like[...]` is accepted where a type is


def first_layer(layers: Stacked[Params], x: jax.Array) -> jax.Array:
    return x @ layers.w[0]  # `Stacked[Params]` reads as `Params`


@dataclasses.dataclass(frozen=True)
class Rules:  # a program's own rules table
    embed: Optional[str] = "data"
    mlp: tuple[str, ...] = ("model",)


class RulesTuple(NamedTuple):
    embed: Optional[str] = None


def own_rules(params: Params) -> Params:
    # A dataclass, a NamedTuple, Flax's pairs: accepted where a table is.
    with axis_rules(Rules()), axis_rules(RulesTuple()):
        table = AxisRules([("embed", "data"), ("mlp", None)])
    return check_tree(params, axis_rules=table)  # still the tree's own type
