"""Figure 19: a step written the field's way (`_field_model`), and its growth.

Steady state, interleaved, each call waited on, against plain `jax.jit` of the
same annotated step (the annotations do nothing there: nothing reads them):

- checked: `jts.jit(step)`, every boundary check on;
- off: the same object in mode "off" (set before each of its batches, untimed);
- annotations: `jts.jit(step, in_shardings="annotations",
  out_shardings="annotations")`, its speculative call;
- again: a second plain `jax.jit(step)`, the noise floor.

On an Explicit and an Auto mesh, at three batch sizes chosen so that plain's
step takes about 5, 10 and 20 ms here (fitted from two probes). Each figure
gives the ratio and the per-call cost in µs (median over repeats of candidate
minus baseline of the same repeat, beside the floor's). The Python calls a
steady-state call makes (cProfile, deterministic) show what the wrapper does
beyond JAX's C++ dispatch. Then the first call (caches cleared), and how the
per-call cost grows from 30 to 93 and 300 parameter leaves.
"""

import statistics
import time
from typing import Any

import _field_model as model  # beside this file
import jax
from _call_cost import (  # beside this file
    calls_per_call,
    compare,
    fixed_cost_note,
    guard_calls,
    guard_us,
    host_cost_us,
    program,
)
from _scaling import exponent
from _timing import (
    default_mode,
    figure,
    interleaved,
    judge_fixed_cost,
    one_shots,
    Settings,
    timed,
)

import jaxtyping_shard as jts


TARGETS_MS = (5.0, 10.0, 20.0)
PROBES = (8, 64)  # batch sizes timed to fit step time against the batch


def _args(kind: str, layers: int, size: int) -> tuple:
    mesh = model.make_mesh(kind)
    with jax.set_mesh(mesh), jts.axis_rules(model.RULES):
        w = model.init(layers, mesh)
        return mesh, (w, model.opt_init(w), model.batch(size, mesh))


def _jits(kind: str) -> dict:
    step = model.make_step(kind == "explicit")
    return {
        "plain": jax.jit(step),
        "checked": jts.jit(step),
        "annotations": jts.jit(
            step, in_shardings="annotations", out_shardings="annotations"
        ),
        "again": jax.jit(step),
    }


def _median_call(fn: Any, args: tuple, n: int = 15) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        times.append(timed_call(fn, args))
    return statistics.median(times)


def timed_call(fn: Any, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def batch_sizes(kind: str, layers: int, smoke: bool) -> list[int]:
    """Batch sizes (multiples of 8) for plain steps of about TARGETS_MS here."""
    if smoke:
        return [PROBES[0]]
    points = []
    for size in PROBES:
        mesh, args = _args(kind, layers, size)
        with jax.set_mesh(mesh), jts.axis_rules(model.RULES):
            points.append(
                _median_call(jax.jit(model.make_step(kind == "explicit")), args)
            )
    slope = max((points[1] - points[0]) / (PROBES[1] - PROBES[0]), 1e-9)
    sizes = []
    for ms in TARGETS_MS:
        size = PROBES[0] + (ms / 1e3 - points[0]) / slope
        sizes.append(max(8, int(round(size / 8)) * 8))
    # Distinct and rising, whatever the fit said.
    out: list[int] = []
    for size in sizes:
        out.append(size if not out or size > out[-1] else out[-1] * 2)
    return out


def _live(fn: Any, mesh: Any, args: tuple) -> bool:
    """The checks are live: the weights replicated are refused."""
    w, opt, batch = args
    wrong = jax.device_put(
        w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    try:
        jax.block_until_ready(fn(wrong, opt, batch))
    except jts.ShardingTypeCheckError:
        return True
    return False


def steady(kind: str, layers: int, size: int, settings: Settings, repeats: int) -> dict:
    """The four candidates' and the floor's seconds a call, interleaved; the
    Python calls a call of each; whether the checks are live."""
    mesh, args = _args(kind, layers, size)
    with jax.set_mesh(mesh), jts.axis_rules(model.RULES):
        jits = _jits(kind)

        def call(name: str) -> Any:
            fn = jits[name]
            return lambda: jax.block_until_ready(fn(*args))

        for fn in jits.values():
            jax.block_until_ready(fn(*args))
        previous = jts.get_mode()
        try:
            times = interleaved(
                {
                    "plain": call("plain"),
                    "checked": call("checked"),
                    "off": call("checked"),
                    "annotations": call("annotations"),
                    "again": call("again"),
                },
                settings,
                setups={
                    name: (
                        lambda m=("off" if name == "off" else "check"): default_mode(m)
                    )
                    for name in ("plain", "checked", "off", "annotations", "again")
                },
                repeats=repeats,
            )
        finally:
            jts.set_mode(previous)
        calls = {name: calls_per_call(fn, args) for name, fn in jits.items()}
        guard = guard_us(jits["annotations"], args)
        calls_in_guard = guard_calls(jits["annotations"], args)
        same = dict.fromkeys(("checked", "off", "annotations"), "not compared")
        if not settings.smoke:  # two more compiles: the full run only
            plain_program = program(jits["plain"], args)
            same = {
                key: compare(plain_program, program(jits[key], args))
                for key in ("checked", "annotations")
            }
            default_mode("off")  # the mode is part of the trace's key
            try:
                same["off"] = compare(plain_program, program(jits["checked"], args))
            finally:
                default_mode("check")
        # `jts.jit(step)` is a `jax.jit` object: its calls take JAX's C++ path.
        fast_path = type(jits["checked"]) is type(jits["plain"])
        live = _live(jits["checked"], mesh, args) and _live(
            jits["annotations"], mesh, args
        )
    return dict(
        times=times,
        calls=calls,
        guard_us=guard,
        guard_calls=calls_in_guard,
        same_program=same,
        fast_path=fast_path,
        live=live,
        leaves=len(jax.tree.leaves(args)),
    )


def per_call_us(candidate: list[float], baseline: list[float]) -> float:
    return statistics.median(c - b for c, b in zip(candidate, baseline)) * 1e6


LABELS = {
    "checked": "jts.jit(step), checks on",
    "off": "jts.jit(step) in mode off",
    "annotations": 'jts.jit(step, in/out_shardings="annotations")',
}


def _rows(name: str, run: dict, target: float | None) -> list[dict]:
    times, calls = run["times"], run["calls"]
    floor_us = per_call_us(times["again"], times["plain"])
    step_s = statistics.median(times["plain"])
    rows = []
    for key, label in LABELS.items():
        extra_calls = (
            calls["annotations" if key == "annotations" else "checked"] - calls["plain"]
        )
        host = (
            host_cost_us(extra_calls, False, run["guard_us"], run["guard_calls"])
            if key == "annotations"
            else host_cost_us(extra_calls, run["fast_path"])
        )
        row = figure(
            f"{name}, {key}",
            f"steady state, {label} / plain jax.jit of the same annotated step",
            times[key],
            times["plain"],
            target,
            "report" if target is None else f"≤ {target}",
            live=run["live"],
            per_call_us=round(per_call_us(times[key], times["plain"]), 1),
            floor_us=round(floor_us, 1),
            python_calls_over_plain=extra_calls,
            same_program_as_plain=run["same_program"][key],
            **(
                {"guard_us": round(run["guard_us"], 2)}
                if key == "annotations"
                else {"jax_jit_object": run["fast_path"]}
            ),
        )
        rows.append(judge_fixed_cost(row, host, step_s, run["same_program"][key]))
    rows.append(
        figure(
            f"{name}, noise floor",
            "a second plain jax.jit of the step / plain jax.jit (two equal sides)",
            times["again"],
            times["plain"],
            None,
            "report",
            live=run["live"],
            per_call_us=round(floor_us, 1),
        )
    )
    return rows


def _first_call(kind: str, size: int, repeats: int) -> dict:
    mesh, args = _args(kind, 3, size)
    with jax.set_mesh(mesh), jts.axis_rules(model.RULES):

        def first(which: str) -> float:
            fresh = _jits(kind)[which]  # a fresh function: no cache holds it
            return timed(lambda: jax.block_until_ready(fresh(*args)))

        shots = one_shots(
            {"plain": lambda: first("plain"), "checked": lambda: first("checked")},
            repeats,
        )
    return figure(
        f"19. field step, {kind.capitalize()}, first call",
        "trace + compile + run, caches cleared: jts.jit(step) / jax.jit(step)",
        shots["checked"],
        shots["plain"],
        None,
        "report",
    )


def growth(settings: Settings) -> list[dict]:
    """The per-call cost at 30, 93 and 300 parameter leaves (Explicit, smallest
    batch): µs over plain and Python calls over plain, with their exponents."""
    layer_counts = (3, 10, 33)
    repeats = 51
    runs = [steady("explicit", n, 8, settings, repeats) for n in layer_counts]
    leaves = [model.leaves_for(n) for n in layer_counts]
    rows = []
    for key in ("checked", "annotations"):
        costs = [per_call_us(r["times"][key], r["times"]["plain"]) for r in runs]
        floors = [per_call_us(r["times"]["again"], r["times"]["plain"]) for r in runs]
        extra = [r["calls"][key] - r["calls"]["plain"] for r in runs]
        guards = [r["guard_us"] for r in runs]
        # A cost within its floor is noise: no exponent is fitted to noise.
        above = all(c > 2 * abs(f) for c, f in zip(costs, floors))
        fitted = exponent(leaves, costs) if above else None
        calls_fit = exponent(leaves, extra) if all(c > 0 for c in extra) else 0.0
        rows.append(
            dict(
                name=f"19. field step, per-call cost growth, {key}",
                what=f"{LABELS[key]} minus plain jax.jit, µs a call, at "
                f"{', '.join(map(str, leaves))} parameter leaves (Explicit, batch 8)",
                ratio=None if fitted is None else round(fitted, 3),
                target=None,
                target_text="report",
                verdict="report",
                candidate_text=", ".join(f"{c:+.0f} µs" for c in costs)
                + ("" if above else " (within the floor)"),
                baseline_text="floor " + ", ".join(f"{f:+.0f} µs" for f in floors),
                per_call_us=[round(c, 1) for c in costs],
                floor_us=[round(f, 1) for f in floors],
                python_calls_over_plain=extra,
                python_calls_exponent=round(calls_fit, 3),
                **(
                    {
                        "guard_us": [round(g, 2) for g in guards],
                        "guard_exponent": round(exponent(leaves, guards), 3),
                    }
                    if key == "annotations"
                    else {}
                ),
                step_s=[statistics.median(r["times"]["plain"]) for r in runs],
                leaves=leaves,
                argument_leaves=[r["leaves"] for r in runs],
                check_is_live=all(r["live"] for r in runs),
            )
        )
    return rows


def figures(settings: Settings) -> list[dict]:
    kinds = ("explicit",) if settings.smoke else ("explicit", "auto")
    rows: list[dict] = []
    for kind in kinds:
        sizes = batch_sizes(kind, 3, settings.smoke)
        for size, ms in zip(sizes, TARGETS_MS):
            run = steady(kind, 3, size, settings, settings.repeats)
            step_ms = statistics.median(run["times"]["plain"]) * 1e3
            name = f"19. field step, {kind.capitalize()}, batch {size} (~{ms:.0f} ms)"
            rows.extend(_rows(name, run, 1.01))
            rows[-1]["step_ms"] = round(step_ms, 2)
        if not settings.smoke:
            rows.append(_first_call(kind, sizes[0], 5))
    if not settings.smoke:  # 10 and 33 layers: compiles of seconds each
        rows.extend(growth(settings))
    return rows


def note(fig: dict) -> str:
    """The line `run.py` prints below the table for a figure with a per-call cost."""
    text = f"{fig['name']}: {_us(fig['per_call_us'])} a call"
    if "floor_us" in fig:
        text += f" (noise floor, plain against plain: {_us(fig['floor_us'])})"
    if "python_calls_over_plain" in fig:
        extra = fig["python_calls_over_plain"]
        text += f"; Python calls a call over plain: {extra}"
    if "python_calls_exponent" in fig:
        text += f" (exponent {fig['python_calls_exponent']})"
    if "guard_us" in fig:
        guard = fig["guard_us"]
        guard = ", ".join(map(str, guard)) if isinstance(guard, list) else guard
        text += f"; the speculation's Python guard: {guard} µs"
    if "guard_exponent" in fig:
        text += f" (exponent {fig['guard_exponent']})"
    if "same_program_as_plain" in fig:
        text += f"; compiled program against plain's: {fig['same_program_as_plain']}"
    return text + fixed_cost_note(fig)


def _us(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(f"{v:+.1f} µs" for v in value)
    return f"{value:+.1f} µs"
