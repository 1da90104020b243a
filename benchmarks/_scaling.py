"""Figures 14-16: how the cost grows. Imported after the CPU device count is forced.

Each figure times the same thing at several sizes, in CPU seconds of this
process (`time.process_time`: other load on a shared machine stretches the
wall clock, not this), and reports the growth as an exponent (the slope of log
time against log size between the two largest sizes: 1 is linear) and a cost
per unit, with the exponent of the Python calls made (deterministic), beside a
ratio against a same-run baseline at the largest size.

14. `check_tree` from 100 to 10,000 leaves (the walk made afresh, and cached).
15. `jts.jit` at 1,000 leaves: first call and steady state, against `jax.jit`.
16. Compile time of 1,000 Auto checks against 1,000 bare
    `jax.debug.inspect_array_sharding`s (and from 100 to 1,000).

Figures 17 and 18 (preflight) are `_preflight_cost`'s, with the same helpers.
"""

import cProfile
import dataclasses
import gc
import math
import pathlib
import pstats
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from _timing import figure, interleaved, one_shots, Settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


W = Float[Array, "a@data b@model"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Leaf:
    w: W


def exponent(sizes: list, seconds: list) -> float:
    """The slope of log(seconds) against log(size): 1 is linear."""
    xs = [math.log(n) for n in sizes]
    ys = [math.log(t) for t in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return num / sum((x - mx) ** 2 for x in xs)


def cpu_timed(fn: Any, clear: bool = True) -> float:
    """CPU seconds of this process (its threads, XLA's included) for one `fn()`,
    caches cleared first (as `_timing.timed`): other load on a shared machine
    stretches the wall clock, not this, so the growth is the code's."""
    if clear:
        jax.clear_caches()
    gc.collect()
    gc.disable()  # as timeit does
    try:
        start = time.process_time()
        fn()
        return time.process_time() - start
    finally:
        gc.enable()


def python_calls(fn: Any) -> int:
    """Python function calls (C functions called from Python included) made by
    `fn()`: work that does not depend on the load of the machine."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


def growth(
    name: str, what: str, unit: str, sizes: list, seconds: list, calls: list
) -> dict:
    """Time's exponent between the two largest sizes (the ratio: fixed costs
    and caches warming blur it below them) and the cost per unit; and the
    exponent of the Python calls made, which the machine's load cannot blur:
    over 1.05 is more than linear work, a defect whatever the clock says."""
    slope = exponent(sizes[-2:], seconds[-2:])
    call_slope = exponent(sizes, calls)
    per = (seconds[-1] - seconds[0]) / (sizes[-1] - sizes[0])
    verdict = "PASS" if slope <= 1.1 else "MISS"
    if call_slope > 1.05:
        verdict = "MISS (calls)"
    return dict(
        name=name,
        what=what,
        ratio=round(slope, 3),
        target=1.1,
        target_text="exponent ≤ 1.1",
        verdict=verdict,
        candidate_text=f"{per * 1e6:.2f} µs/{unit}",
        baseline_text=", ".join(
            f"{n}: {t * 1e3:.1f} ms" for n, t in zip(sizes, seconds)
        ),
        exponent=slope,
        exponent_all_sizes=round(exponent(sizes, seconds), 3),
        calls_exponent=round(call_slope, 3),
        per_unit_s=per,
        sizes=list(sizes),
        seconds=list(seconds),
        python_calls=list(calls),
        check_is_live=True,
    )


def _mesh(kind: str = "explicit") -> Any:
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)


def _tree(mesh: Any, n: int) -> list:
    x = jax.device_put(jnp.zeros((8, 16)), NamedSharding(mesh, P("data", "model")))
    return [Leaf(x) for _ in range(n)]


def check_tree_growth(settings: Settings) -> list[dict]:
    mesh = _mesh()
    sizes = [100, 1000] if settings.smoke else [100, 1000, 10000]
    runs = 2 if settings.smoke else 5
    fresh, cached, fresh_calls, cached_calls = [], [], [], []
    for n in sizes:
        tree = _tree(mesh, n)

        def first(tree: list = tree) -> float:
            tree.append(tree[0])  # a structure the walk has not seen: one longer
            return cpu_timed(lambda: jts.check_tree(tree), clear=False)

        fresh.append(min(first() for _ in range(runs)))
        cached.append(
            min(
                cpu_timed(lambda tree=tree: jts.check_tree(tree), clear=False)
                for _ in range(runs)
            )
        )
        cached_calls.append(python_calls(lambda tree=tree: jts.check_tree(tree)))
        tree.append(tree[0])
        fresh_calls.append(python_calls(lambda tree=tree: jts.check_tree(tree)))
    tree = _tree(mesh, sizes[-1])
    leaves = jax.tree_util.tree_leaves(tree)

    def loop() -> None:
        for leaf in leaves:
            if not isinstance(leaf, W):
                raise TypeError

    times = interleaved(
        {"loop": loop, "check_tree": lambda: jts.check_tree(tree)},
        settings,
        repeats=5 if settings.smoke else 21,
    )
    try:
        jts.check_tree(jax.device_put(tree, NamedSharding(mesh, P())))
        live = False
    except jts.ShardingTypeCheckError:
        live = True
    what = "jts.check_tree over a list of annotated dataclasses"
    return [
        growth(
            "14. check_tree, walk made",
            f"{what}, each structure new",
            "leaf",
            sizes,
            fresh,
            fresh_calls,
        ),
        growth(
            "14. check_tree, walk cached",
            f"{what}, the same structure",
            "leaf",
            sizes,
            cached,
            cached_calls,
        ),
        figure(
            f"14. check_tree, {sizes[-1]} leaves",
            f"{what} / a loop of isinstance on the same leaves",
            times["check_tree"],
            times["loop"],
            1.2,
            "≤ 1.2",
            live=live,
        ),
    ]


def _step(tree: list[Leaf]) -> list[Leaf]:
    return jax.tree.map(lambda w: w * 0.5, tree)


def _jits(tree: list) -> tuple:
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    ours = jts.jit(_step, in_shardings="annotations", out_shardings="annotations")
    plain = jax.jit(_step, in_shardings=(shardings,), out_shardings=shardings)
    return ours, plain


def jit_growth(settings: Settings) -> list[dict]:
    mesh = _mesh()
    sizes = [10, 100] if settings.smoke else [100, 1000]
    firsts, plains, calls = [], [], []
    repeats = 1 if settings.smoke else 5
    for n in sizes:
        tree = _tree(mesh, n)
        times = one_shots(
            {
                "plain": lambda tree=tree: cpu_timed(lambda: _jits(tree)[1](tree)),
                "ours": lambda tree=tree: cpu_timed(lambda: _jits(tree)[0](tree)),
            },
            repeats,
        )
        firsts.append(statistics.median(times["ours"]))
        plains.append(statistics.median(times["plain"]))
        jax.clear_caches()
        calls.append(python_calls(lambda tree=tree: _jits(tree)[0](tree)))
    ours, plain = _jits(tree)
    again = _jits(tree)[1]  # the noise floor: plain against a second plain
    ours(tree), plain(tree), again(tree)
    steady_calls = [steady_python_calls(fn, tree) for fn in (ours, plain)]
    steady = interleaved(
        {
            "plain": lambda: jax.block_until_ready(plain(tree)),
            "ours": lambda: jax.block_until_ready(ours(tree)),
            "again": lambda: jax.block_until_ready(again(tree)),
        },
        settings,
        repeats=5 if settings.smoke else 51,
    )
    try:
        ours(jax.device_put(tree, NamedSharding(mesh, P())))
        live = False
    except jts.ShardingTypeCheckError:
        live = True
    n = sizes[-1]
    return [
        figure(
            f"15. jts.jit first call, {n} leaves",
            "trace + compile + run of jts.jit(annotations) / jax.jit with shardings "
            "by hand, caches cleared",
            [firsts[-1]],
            [plains[-1]],
            None,
            "report",
            live=live,
        ),
        growth(
            "15. jts.jit first call, growth",
            f"jts.jit(annotations) first call, {sizes[0]} -> {sizes[-1]} leaves",
            "leaf",
            sizes,
            firsts,
            calls,
        ),
        figure(
            f"15. jts.jit steady state, {n} leaves",
            "steady-state call, jts.jit(annotations) / jax.jit, block_until_ready",
            steady["ours"],
            steady["plain"],
            1.02,
            "1.00 (≤ 1.02)",
            live=live,
            python_calls_over_plain=steady_calls[0] - steady_calls[1],
        ),
        figure(
            f"15. jts.jit steady state, {n} leaves, noise floor",
            "a second jax.jit with the same shardings / jax.jit (two equal sides)",
            steady["again"],
            steady["plain"],
            None,
            "report",
        ),
    ]


def steady_python_calls(fn: Any, tree: list, n: int = 20) -> float:
    """Python calls a steady-state call makes, its wait included (cProfile:
    deterministic, so the machine's load cannot blur it)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        jax.block_until_ready(fn(tree))
    profile.disable()
    return pstats.Stats(profile).total_calls / n  # type: ignore[attr-defined]


def _chain(n: int, annotation: Any, bare: bool) -> Any:
    def f(x):
        y = x
        for _ in range(n):
            y = jnp.sin(y)
            if not isinstance(y, annotation):
                raise TypeError("check failed at trace time")
            if bare:
                jax.debug.inspect_array_sharding(y, callback=lambda s: None)
        return y

    return f


def compile_growth(settings: Settings) -> list[dict]:
    mesh = _mesh("auto")
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("data", None)))
    ours_ann, plain_ann = Float[Array, "b@data e"], Float[Array, "b e"]
    sizes = [10, 100] if settings.smoke else [100, 1000]
    ours_t, bare_t, ours_calls, bare_calls, times = [], [], [], [], {}

    def compile_of(n: int, annotation: Any, bare: bool) -> Any:
        return lambda: jax.jit(_chain(n, annotation, bare)).lower(x).compile()

    for n in sizes:
        ours, bare = compile_of(n, ours_ann, False), compile_of(n, plain_ann, True)
        times = one_shots(
            {
                "bare": lambda bare=bare: cpu_timed(bare),
                "ours": lambda ours=ours: cpu_timed(ours),
            },
            1 if settings.smoke else 5,
        )
        ours_t.append(statistics.median(times["ours"]))
        bare_t.append(statistics.median(times["bare"]))
        jax.clear_caches()
        ours_calls.append(python_calls(ours))
        jax.clear_caches()
        bare_calls.append(python_calls(bare))
    try:
        jax.jit(_chain(10, Float[Array, "b@model e"], False)).lower(x).compile()
        live = False
    except jts.ShardingTypeCheckError:
        live = True
    return [
        figure(
            f"16. compile, {sizes[-1]} Auto checks / bare",
            "jax.jit(f).lower(x).compile() with a check per op / with a bare "
            "inspect_array_sharding per op",
            times["ours"],
            times["bare"],
            1.10,
            "≤ 1.10",
            live=live,
        ),
        growth(
            "16. compile, checks, growth",
            f"compile with {sizes[0]} -> {sizes[-1]} Auto checks",
            "check",
            sizes,
            ours_t,
            ours_calls,
        ),
        growth(
            "16. compile, bare, growth",
            f"compile with {sizes[0]} -> {sizes[-1]} bare inspect_array_sharding",
            "inspect",
            sizes,
            bare_t,
            bare_calls,
        ),
    ]


def figures(settings: Settings) -> list[dict]:
    return [
        *check_tree_growth(settings),
        *jit_growth(settings),
        *compile_growth(settings),
    ]
