"""Timing for the figures: interleaved batches, paired ratios, one table row.

Every figure is a ratio against a baseline timed in the same process, in
interleaved batches (a fresh order each repeat), so that drift and other load
on the machine hit both sides alike. The ratio is the median over repeats of
candidate / baseline of the same repeat.
"""

import gc
import math
import random
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import jax

import jaxtyping_shard as jts


def default_mode(mode: str) -> None:
    """Sets the process default mode, as `JAXTYPING_SHARD_MODE` does, and fails
    if a scope of this thread hides it (a `with set_mode(...)` around a figure
    would: a scope outranks the default, so a figure "in mode off" would time
    mode check)."""
    jts.set_mode(mode)  # type: ignore[arg-type]
    if jts.get_mode() != mode:
        raise RuntimeError(
            f"the default mode {mode!r} is hidden by a scope in mode "
            f"{jts.get_mode()!r}: set the default, do not open a scope, around figures"
        )


class Settings:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.repeats = 9 if smoke else 101  # timed batches per side
        self.batch_s = 0.002 if smoke else 0.01  # length of one batch
        self.one_shot_repeats = 3 if smoke else 21  # compiles / traces per side


def _calibrate(timer: timeit.Timer, batch_s: float) -> int:
    number = 1
    while True:
        took = timer.timeit(number)
        if took >= batch_s or number >= 1 << 20:
            return number
        number = max(number * 2, int(number * batch_s / max(took, 1e-9)))


def interleaved(
    stmts: dict[str, Callable[[], Any]],
    settings: Settings,
    setups: dict[str, Callable[[], Any]] | None = None,
    repeats: int | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each statement, one list entry per repeat.

    The first statement is the baseline; the batch size is calibrated on it and
    used for all, and the statements run in a fresh (seeded) order each repeat. A
    statement's setup (`setups`) runs before each of its batches, untimed: what
    the statement needs in force (a mode) without timing the switch to it.
    `repeats` overrides the settings' number of repeats.
    """
    setups = setups or {}
    timers = {
        name: timeit.Timer(fn, setup=setups.get(name, "pass"))
        for name, fn in stmts.items()
    }
    for timer in timers.values():
        timer.timeit(3)  # warm up: caches, compiled code, first-call paths
    number = _calibrate(next(iter(timers.values())), settings.batch_s)
    names = list(timers)
    out: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(settings.repeats if repeats is None else repeats):
        # A fresh order each repeat: with three or more statements a rotation
        # keeps each one behind the same predecessor, whose leftovers (buffers
        # freed, XLA threads still winding down) then bias its ratio.
        for name in order.sample(names, len(names)):
            # timeit disables the garbage collector while it runs.
            out[name].append(timers[name].timeit(number) / number)
    return out


def one_shots(
    runs: dict[str, Callable[[], float]], repeats: int
) -> dict[str, list[float]]:
    """Like `interleaved`, for runs that time themselves once (compile, trace)."""
    names = list(runs)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(runs[name]())
    return out


def paired_ratio(candidate: list[float], baseline: list[float]) -> float:
    return statistics.median(c / b for c, b in zip(candidate, baseline))


def ratio_error(candidate: list[float], baseline: list[float]) -> float | None:
    """The standard error of `paired_ratio`, from the spread of its per-repeat
    ratios: 1.2533 sd / sqrt(n), a median's for a near-normal spread (None with
    fewer than two repeats)."""
    ratios = [c / b for c, b in zip(candidate, baseline)]
    if len(ratios) < 2:
        return None
    return 1.2533 * statistics.stdev(ratios) / math.sqrt(len(ratios))


# The programs a step figure takes for plain's (`_call_cost.compare`): the same
# text, or the same instructions in an order XLA's scheduler chose otherwise.
PLAIN_PROGRAMS = ("identical", "same instructions, other order")


def judge_fixed_cost(
    row: dict, host_us: float | None, step_s: float, same: str
) -> dict:
    """A steady-state step figure whose timed ratio misses its target, judged by
    what the call does beyond plain's instead (benchmarks/README, "Steady-state
    step figures"): PASS (fixed cost) when the host-side work the call adds
    (`host_us`: measured, deterministic where it is nothing; None when it is
    not known) is within the target at this step time, the compiled program is
    plain's, and the timed ratio is within two of its standard errors of 1.00
    (this run cannot tell it from two equal sides). Otherwise the MISS stands."""
    row["host_cost_us"] = None if host_us is None else round(host_us, 2)
    row["host_cost_share"] = None if host_us is None else host_us / (step_s * 1e6)
    if row["verdict"] != "MISS" or row["target"] is None or host_us is None:
        return row
    error = row.get("ratio_se")
    if (
        error is not None
        and host_us <= (row["target"] - 1) * step_s * 1e6
        and same in PLAIN_PROGRAMS
        and row["ratio"] - 1 <= 2 * error
    ):
        row["verdict"] = "PASS (fixed cost)"
    return row


def fmt_s(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.3f} µs"


def figure(
    name: str,
    what: str,
    candidate: list[float],
    baseline: list[float],
    target: float | None,
    target_text: str,
    ratio: float | None = None,
    live: bool = True,
    **extra: Any,
) -> dict:
    if ratio is None:
        ratio = paired_ratio(candidate, baseline)
    cand_med = statistics.median(candidate)
    base_med = statistics.median(baseline)
    if not live:
        verdict = "MISS (check not live)"
    elif target is None:
        verdict = "report"
    else:
        verdict = "PASS" if ratio <= target else "MISS"
    paired = len(candidate) == len(baseline)
    error = ratio_error(candidate, baseline) if paired else None
    if error is not None:
        extra.setdefault("ratio_se", round(error, 4))
    return dict(
        name=name,
        what=what,
        ratio=round(ratio, 4),
        target=target,
        target_text=target_text,
        verdict=verdict,
        candidate_median_s=cand_med,
        baseline_median_s=base_med,
        candidate_text=fmt_s(cand_med),
        baseline_text=fmt_s(base_med),
        repeats=len(candidate),
        check_is_live=live,
        **extra,
    )


# Figures 1 and 2: eager calls under jaxtyped(typechecker=beartype).


def timed(step: Callable[[], Any]) -> float:
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start
