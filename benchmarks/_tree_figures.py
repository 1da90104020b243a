"""Figures 10 and 11: whole trees. Imported only after the CPU device count is forced.

10. `check_tree` over a 100-leaf parameter tree, against a loop of `isinstance` on
   the same leaves with the same annotations (the leaves flattened beforehand).
11. A `jaxtyping_shard.jit` step taking that tree: the boundary checks run once
   per signature, so a steady-state call costs what the same wrapper without
   them costs; the tree walk must not run at all during the timed calls.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from _timing import figure, interleaved, Settings  # beside this file
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._drivers.jit import boundary as _boundary
from jaxtyping_shard._trees import walk as _tree


BLOCKS = 25  # four leaves each: 100 leaves

W_IN = Float[Array, "embed mlp", P("data", "model")]
W_OUT = Float[Array, "mlp@model embed@data"]
BIAS = Float[Array, "mlp@model"]
SCALE = Float[Array, "embed", P()]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    w_in: W_IN
    w_out: W_OUT
    bias: BIAS
    scale: SCALE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    blocks: list[Block]


def _params() -> Any:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def put(shape: tuple, spec: Any) -> Any:
        return jax.device_put(jnp.zeros(shape), NamedSharding(mesh, spec))

    blocks = [
        Block(
            put((8, 16), P("data", "model")),
            put((16, 8), P("model", "data")),
            put((16,), P("model")),
            put((8,), P()),
        )
        for _ in range(BLOCKS)
    ]
    return mesh, Params(blocks)


def check_tree_figure(settings: Settings) -> dict:
    mesh, params = _params()
    leaves = jax.tree_util.tree_leaves(params)
    annotations = [W_IN, W_OUT, BIAS, SCALE] * BLOCKS
    assert len(leaves) == 100
    pairs = list(zip(leaves, annotations))

    def loop() -> None:
        for leaf, annotation in pairs:
            if not isinstance(leaf, annotation):
                raise TypeError

    loop()
    jts.check_tree(params)
    wrong = jax.device_put(params, NamedSharding(mesh, P()))
    try:
        jts.check_tree(wrong)
        live = False
    except jts.ShardingTypeCheckError as error:
        live = str(error).startswith("check_tree(tree): 75 of 100")
    times = interleaved(
        {"loop": loop, "check_tree": lambda: jts.check_tree(params)}, settings
    )
    return figure(
        "10. check_tree, 100 leaves",
        "jts.check_tree(params) with field annotations / a loop of isinstance "
        "on the same (pre-flattened) leaves and annotations",
        times["check_tree"],
        times["loop"],
        1.2,
        "≤ 1.2",
        live=live,
    )


def jit_tree_figures(settings: Settings) -> list[dict]:
    mesh, params = _params()

    def step(params: Params) -> Params:
        return jax.tree.map(lambda p: p * 0.5, params)

    ours = jts.jit(step)
    # The same wrapper without the boundary tree checks: what they cost.
    checked = _boundary.checked
    _boundary.checked = lambda fun, *args, **kwargs: fun
    try:
        unchecked = jts.jit(step)
    finally:
        _boundary.checked = checked
    plain = jax.jit(step)
    again = jax.jit(step)  # the noise floor: plain against a second plain
    for fn in (ours, unchecked, plain, again):
        fn(params)
    walks: list[int] = []
    original = _tree.plan_for

    def counting(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return original(*args, **kwargs)

    _tree.plan_for = counting
    try:
        times = interleaved(
            {
                "unchecked": lambda: jax.block_until_ready(unchecked(params)),
                "ours": lambda: jax.block_until_ready(ours(params)),
                "plain": lambda: jax.block_until_ready(plain(params)),
                "again": lambda: jax.block_until_ready(again(params)),
            },
            settings,
        )
    finally:
        _tree.plan_for = original
    wrong = jax.device_put(params, NamedSharding(mesh, P()))
    try:
        ours(wrong)
        caught = False
    except jts.ShardingTypeCheckError:
        caught = True
    boundary = figure(
        "11. jit steady state, 100-leaf tree",
        "steady-state call of jts.jit(step) on the tree / the same wrapper without "
        "boundary tree checks, block_until_ready; the tree walk must not run",
        times["ours"],
        times["unchecked"],
        1.02,
        "1.00 (≤ 1.02)",
        live=caught,
        walks_during_timed_calls=len(walks),
    )
    if walks:
        boundary["verdict"] = "MISS (tree walked in steady state)"
    overall = figure(
        "11. jit, 100-leaf tree, vs jax.jit",
        "steady-state call of jts.jit(step) / jax.jit(step) on the tree",
        times["ours"],
        times["plain"],
        None,
        "report",
        jax_jit_object=type(ours) is type(plain),
    )
    floor = figure(
        "11. jit, 100-leaf tree, noise floor",
        "a second jax.jit(step) / jax.jit(step) on the tree (two equal sides)",
        times["again"],
        times["plain"],
        None,
        "report",
    )
    return [boundary, overall, floor]
