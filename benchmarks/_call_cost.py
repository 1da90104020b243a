"""What a steady-state call does beyond plain `jax.jit`'s, measured without the
clock (figures 12 and 19; benchmarks/README, "Steady-state step figures"): the
Python calls it makes (cProfile), the speculation's guard (timeit), the
compiled program against plain's, and the host-side cost a call these give.
"""

import cProfile
import pstats
import re
import timeit
from typing import Any

import jax

from jaxtyping_shard._core.modes import mode_reader


def calls_per_call(fn: Any, args: tuple, n: int = 50) -> float:
    """Python calls (C functions called from Python included) a steady-state
    call makes, `block_until_ready` of its result included: deterministic."""
    for _ in range(3):  # warm in the mode in force: its traces and caches
        jax.block_until_ready(fn(*args))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        jax.block_until_ready(fn(*args))  # waited on: CPU collectives deadlock
    profile.disable()  # when too many programs are queued
    return pstats.Stats(profile).total_calls / n  # type: ignore[attr-defined]


def guard_us(fn: Any, args: tuple) -> float:
    """What `jts.jit(in_shardings="annotations")`'s speculative call runs in
    Python before JAX's C++ dispatch (`Speculation.fits`, and entering and
    leaving `jax.no_tracing(True)`), µs a call: the best of five timeit runs."""
    n = 2000
    return min(timeit.repeat(_guard(fn, args), number=n, repeat=5)) / n * 1e6


def guard_calls(fn: Any, args: tuple, n: int = 50) -> float:
    """The Python calls that guard makes (cProfile): deterministic."""
    guard = _guard(fn, args)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        guard()
    profile.disable()
    return pstats.Stats(profile).total_calls / n  # type: ignore[attr-defined]


def _guard(fn: Any, args: tuple) -> Any:
    last = fn._last[mode_reader.value]

    def guard() -> None:
        last.fits(args)
        with jax.no_tracing(True):
            last.entry.tree()

    return guard


def program(fn: Any, args: tuple) -> list[str]:
    """The compiled program's instructions, in order, without their metadata
    (source lines, which name the boundary checks' file for `jts.jit`)."""
    out = []
    for line in fn.lower(*args).compile().as_text().splitlines():
        if " = " not in line:
            continue  # the file and stack-frame tables, computation headers
        line = re.sub(
            r", (metadata|origin|frontend_attributes)=\{.*?\}(?=,|$)", "", line
        )
        out.append(line.strip())
    return out


def compare(plain: list[str], other: list[str]) -> str:
    """`identical`, `same instructions, other order` (numbering aside), or
    `different`."""
    if plain == other:
        return "identical"

    def norm(lines: list[str]) -> list[str]:
        return sorted(re.sub(r"\.\d+\b", "", line) for line in lines)

    return (
        "same instructions, other order" if norm(plain) == norm(other) else "different"
    )


# What a Python call beyond the guard's is counted at (a bound, not a reading:
# a call of a Python function takes about 0.05-0.1 µs here).
CALL_US = 1.0


def host_cost_us(
    extra_calls: float,
    fast_path: bool,
    guard: float | None = None,
    calls_in_guard: float = 0.0,
) -> float | None:
    """What a call adds on the host beyond plain's: nothing for a `jax.jit`
    object making no Python call more (the same C++ dispatch); for the
    speculation's call, its guard's measured time plus `CALL_US` for each extra
    call the guard does not make (the wrapper's own frames); else unknown
    (None)."""
    if extra_calls == 0 and fast_path:
        return 0.0
    if guard is not None:
        return guard + max(0.0, extra_calls - calls_in_guard) * CALL_US
    return None


def fixed_cost_note(fig: dict) -> str:
    """The timed ratio's standard error and the host-side cost beside it."""
    text = ""
    if "ratio_se" in fig:
        text += f"; timed ratio {fig['ratio']:.3f} ± {fig['ratio_se']:.3f} (s.e.)"
    if "host_cost_us" in fig:
        cost = fig["host_cost_us"]
        shown = "unknown" if cost is None else f"{cost:.2f} µs"
        text += f"; host-side cost a call over plain: {shown}"
        if cost is not None:
            text += f" ({fig['host_cost_share']:.3%} of the step)"
    return text
