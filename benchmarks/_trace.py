"""Figure 6: what an Explicit check costs at trace time, and how it grows.

`jax.jit(f).trace(x)` of a chain of `jnp.sin` ops whose every result is
checked with `isinstance(y, A)`, 10, 100 and 1,000 checks, Explicit mesh axes
(the check is decided while JAX traces). Each trace clears JAX's caches first
and, for ours, takes a fresh annotation (so it keeps no pass from an earlier
trace: each trace pays for its first verdict, as a new program does). Timed in
CPU seconds of this process (`time.process_time`: other load on a shared
machine stretches the wall clock, not this). Three sides, interleaved: plain
jaxtyping, ours, and plain again (the noise floor: plain against plain).

The cost of a check is (ours - plain) / checks, from the least time of each
side over the repeats (on a loaded machine the least is the run the load hit
least); at 1,000 checks and 21 repeats that is 21,000 checks a side. The
median of the paired differences is printed beside it.
"""

import statistics
from typing import Any

import _scaling  # beside this file
import jax
import jax.numpy as jnp
from _setup import make_mesh, place, PLAIN, raises, sharded  # beside this file
from _timing import figure, one_shots, Settings
from jax.sharding import PartitionSpec as P


SIZES = (10, 100, 1000)
TARGET_US = 5.0  # issue 38, item 3: an Explicit check at most 5 µs at trace time


def _chain(n: int, annotation: Any) -> Any:
    def f(x):
        y = x
        for _ in range(n):
            y = jnp.sin(y)
            if not isinstance(y, annotation):
                raise TypeError("check failed at trace time")
        return y

    return f


def _per_check(ours: list, plain: list, n: int) -> tuple[float, float]:
    """(least-time, median-of-pairs) extra seconds per check."""
    least = (min(ours) - min(plain)) / n
    paired = statistics.median((o - p) / n for o, p in zip(ours, plain))
    return least, paired


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:+.2f} µs/check"


def trace_figures(settings: Settings) -> list[dict]:
    mesh = make_mesh("explicit")
    x = place(mesh, P("data", None))
    live = raises(lambda: jax.jit(_chain(3, sharded(P("model", None)))).trace(x))

    def trace_of(n: int, fresh: bool) -> Any:
        def run() -> float:
            annotation = sharded(P("data", None)) if fresh else PLAIN
            f = jax.jit(_chain(n, annotation))
            return _scaling.cpu_timed(lambda: f.trace(x))

        return run

    sizes = SIZES[:2] if settings.smoke else SIZES
    times: dict[int, dict[str, list[float]]] = {}
    calls = []
    for n in sizes:
        times[n] = one_shots(
            {
                "plain": trace_of(n, False),
                "ours": trace_of(n, True),
                "plain2": trace_of(n, False),
            },
            settings.one_shot_repeats,
        )
        jax.clear_caches()
        traced = jax.jit(_chain(n, sharded(P("data", None))))
        calls.append(_scaling.python_calls(lambda f=traced: f.trace(x)))
    per_size = {}
    for n in sizes:
        t = times[n]
        least, paired = _per_check(t["ours"], t["plain"], n)
        floor_least, floor_paired = _per_check(t["plain2"], t["plain"], n)
        per_size[n] = dict(
            extra_per_check_s=least,
            extra_per_check_paired_s=paired,
            floor_per_check_s=floor_least,
            floor_per_check_paired_s=floor_paired,
            ours_min_s=min(t["ours"]),
            plain_min_s=min(t["plain"]),
        )
    mid, top = (100 if 100 in times else sizes[-1]), sizes[-1]
    least, paired = (
        per_size[top]["extra_per_check_s"],
        per_size[top]["extra_per_check_paired_s"],
    )
    floor = per_size[top]["floor_per_check_s"]
    # A MISS only when the cost is over the target by more than the noise.
    verdict = "PASS" if least <= TARGET_US * 1e-6 + abs(floor) else "MISS"
    out = [
        figure(
            f"6. trace, {mid} Explicit checks",
            f"jax.jit(f).trace(x), caches cleared, {mid} checks, Explicit, CPU "
            "seconds: sharded annotations / plain jaxtyping",
            times[mid]["ours"],
            times[mid]["plain"],
            None,
            "report",
            live=live,
            extra_per_check_s=per_size[mid]["extra_per_check_s"],
        ),
        dict(
            name=f"6. trace, per check ({top:,} checks)",
            what=f"(ours - plain) / {top} of the least CPU time over "
            f"{len(times[top]['ours'])} traces, against the noise floor "
            "(plain - plain)",
            ratio=None,
            target=TARGET_US,
            target_text=f"≤ {TARGET_US:g} µs/check",
            verdict=verdict if live else "MISS (check not live)",
            candidate_text=f"{_us(least)} (pairs {_us(paired)})",
            baseline_text=f"floor {_us(floor)}",
            check_is_live=live,
            per_check_by_checks={str(n): v for n, v in per_size.items()},
        ),
        _scaling.growth(
            "6. trace, growth",
            f"trace with {sizes[0]} -> {top} Explicit checks (ours, least CPU time)",
            "sin op and its check",
            list(sizes),
            [per_size[n]["ours_min_s"] for n in sizes],
            calls,
        ),
    ]
    out[-1]["plain_exponent"] = round(
        _scaling.exponent(
            list(sizes[-2:]), [per_size[n]["plain_min_s"] for n in sizes[-2:]]
        ),
        3,
    )
    return out
