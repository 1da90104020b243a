"""The figures of `run.py`. Imported only after the CPU device count is forced.

Every figure is a ratio against a baseline timed in the same process, in
interleaved batches (a fresh order each repeat), so that drift and other load
on the machine hit both sides alike. The ratio is the median over repeats of
candidate / baseline of the same repeat. The `_*` modules imported are beside
this file (run.py puts it on sys.path).
"""

import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import _call_cost  # beside this file
import _collectives  # beside this file, as _timing
import _eager  # beside this file
import _field_step  # beside this file
import _init_memory  # beside this file, as _timing
import _placement  # beside this file, as _timing
import _pod  # beside this file
import _preflight_cost  # beside this file
import _scaling  # beside this file
import _timing  # beside this file
import _trace  # beside this file
import _transformer  # beside this file
import _tree_figures  # beside this file
import jax
import jax.numpy as jnp
from _first_call import first_call  # beside this file, as _timing
from _setup import make_mesh, place, PLAIN, raises, sharded  # beside this file
from _timing import figure, fmt_s, interleaved, one_shots, Settings, timed
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import jaxtyped

import jaxtyping_shard as jts


CHAIN = 100  # checks per function in the compile and trace figures


# Figures 1 and 2 are in _eager.py (timed in fresh processes).


# Figure 3: one cached verdict, per array.


def cache_hit(settings: Settings) -> dict:
    x = place(make_mesh("explicit"), P("data", None))
    ours = sharded(P("data", None))
    assert isinstance(x, ours) and isinstance(x, PLAIN)
    # isinstance is what beartype's wrappers call: the hot path.
    times = interleaved(
        {
            "plain": lambda: isinstance(x, PLAIN),
            "ours": lambda: isinstance(x, ours),
            "floor": lambda: hash(x.sharding),
        },
        settings,
    )
    extra = [c - b for c, b in zip(times["ours"], times["plain"])]
    ratio = statistics.median(e / f for e, f in zip(extra, times["floor"]))
    live = ours.__instancecheck_str__(place(make_mesh("explicit"), P("model"))) != ""
    out = figure(
        "3. cached verdict, per array",
        "isinstance(x, A), sharded minus plain annotation, against the floor "
        "hash(x.sharding)",
        extra,
        times["floor"],
        3.0,
        "≤ 3x floor",
        ratio=ratio,
        live=live,
        plain_instancecheck_median_s=statistics.median(times["plain"]),
    )
    out["candidate_text"] = f"+{fmt_s(statistics.median(extra))}"
    return out


# Figure 4: a compiled checked function, called.


def _jit_fns(spec: Any, checked: bool) -> Any:
    def f(x):
        return x * 2

    if checked:
        f.__annotations__ = {"x": sharded(spec), "return": sharded(spec)}
        return jaxtyped(typechecker=beartype)(f)
    return f


def _bare_inspect_fn(x):
    jax.debug.inspect_array_sharding(x, callback=lambda s: None)
    return x * 2


def jit_steady(settings: Settings) -> list[dict]:
    mesh = make_mesh("auto")
    x = place(mesh, P("data", None))
    ours = jts.jit(_jit_fns(P("data", None), checked=True))
    raw = jax.jit(_jit_fns(P("data", None), checked=True))
    plain = jax.jit(_jit_fns(P("data", None), checked=False))
    bare = jax.jit(_bare_inspect_fn)
    hlo = raw.lower(x).compile().as_text()
    custom_calls = hlo.count("custom-call(")
    wrong = jts.jit(_jit_fns(P("model", None), checked=True))
    live = raises(lambda: wrong(x), jts.ShardingTypeCheckError)
    times = interleaved(
        {
            "plain": lambda: plain(x).block_until_ready(),
            "ours": lambda: ours(x).block_until_ready(),
            "raw": lambda: raw(x).block_until_ready(),
            "bare": lambda: bare(x).block_until_ready(),
        },
        settings,
    )
    steady = figure(
        "4. jit call, Auto mesh",
        "steady-state call of jaxtyping_shard.jit(checked f) / jax.jit(f), "
        "block_until_ready",
        times["ours"],
        times["plain"],
        1.02,
        "1.00 (≤ 1.02)",
        live=live,
    )
    raw_fig = figure(
        "4. jit call, plain jax.jit",
        "steady-state call of jax.jit(checked f) / jax.jit(f): the checks add "
        "no effect, so plain jax.jit keeps JAX's C++ dispatch fast path too",
        times["raw"],
        times["plain"],
        1.02,
        "1.00 (≤ 1.02)",
        live=live,
    )
    bare_fig = figure(
        "4. jit call, bare inspect",
        "steady-state call of jax.jit(f with one bare inspect_array_sharding) / "
        "jax.jit(f): what any inspect_array_sharding costs per call",
        times["bare"],
        times["plain"],
        None,
        "report",
    )
    return [
        steady,
        raw_fig,
        bare_fig,
        dict(
            name="4. HLO custom-calls",
            what="count of `custom-call(` in jax.jit(checked f).lower(x).compile()",
            ratio=None,
            target=0,
            target_text="0",
            verdict="PASS" if custom_calls == 0 else "MISS",
            candidate_text=f"{custom_calls} custom-call",
            baseline_text="-",
            custom_calls=custom_calls,
            check_is_live=live,
        ),
    ]


# Figure 5: compile time of 100 checks (figure 6, trace time, is _trace.py's).


def _chain(annotation: Any, bare_inspect: bool, length: int = CHAIN) -> Any:
    def f(x):
        y = x
        for _ in range(length):
            y = jnp.sin(y)
            if not isinstance(y, annotation):
                raise TypeError("check failed at trace time")
            if bare_inspect:
                jax.debug.inspect_array_sharding(y, callback=lambda s: None)
        return y

    return f


def compile_time(settings: Settings) -> list[dict]:
    mesh = make_mesh("auto")
    x = place(mesh, P("data", None))
    ours_ann = sharded(P("data", None))

    def compile_of(
        annotation: Any, bare: bool, length: int = CHAIN
    ) -> Callable[[], float]:
        return lambda: timed(
            lambda: jax.jit(_chain(annotation, bare, length)).lower(x).compile()
        )

    def wrong_compile():
        with jts.sharding_errors():
            jax.jit(_chain(sharded(P("model", None)), False)).lower(x).compile()

    live = raises(wrong_compile, jts.ShardingTypeCheckError)
    times = one_shots(
        {
            "plain": compile_of(PLAIN, False),
            "ours": compile_of(ours_ann, False),
            "bare": compile_of(PLAIN, True),
        },
        settings.one_shot_repeats,
    )
    # 1,000 checks: one call of 1,000 operands (no results, no sharding rule),
    # whose cost grows with its operands in proportion (figure 16: against bare).
    long = 10 * CHAIN
    times_long = one_shots(
        {
            "plain": compile_of(PLAIN, False, long),
            "ours": compile_of(ours_ann, False, long),
        },
        max(1, settings.one_shot_repeats // 4),
    )
    what = f"jax.jit(f).lower(x).compile(), caches cleared, {CHAIN} checks, Auto"
    return [
        figure(
            "5. compile, 100 Auto checks",
            f"{what}: sharded annotations / plain jaxtyping",
            times["ours"],
            times["plain"],
            1.25,
            "≤ 1.25",
            live=live,
            ratio_of_minima=round(min(times["ours"]) / min(times["plain"]), 4),
        ),
        figure(
            "5. compile, 1,000 Auto checks",
            f"{what.replace(str(CHAIN), f'{long:,}')}: sharded annotations / plain "
            "jaxtyping",
            times_long["ours"],
            times_long["plain"],
            None,
            "report",
            live=live,
            ratio_of_minima=round(
                min(times_long["ours"]) / min(times_long["plain"]), 4
            ),
        ),
        figure(
            "5. compile, 100 bare inspects",
            f"{what}: plain + bare inspect_array_sharding / plain",
            times["bare"],
            times["plain"],
            None,
            "report",
        ),
        figure(
            "5. compile, ours / bare",
            f"{what}: sharded annotations / plain + bare inspect_array_sharding",
            times["ours"],
            times["bare"],
            1.10,
            "≤ 1.10",
            live=live,
        ),
    ]


def run_all(smoke: bool, progress: TextIO) -> list[dict]:
    settings = Settings(smoke)
    assert jax.device_count() >= 8, "run.py forces 8 CPU devices before importing JAX"
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("eager, in fresh processes", lambda: _eager.figures(settings)),
        ("cached verdict", lambda: cache_hit(settings)),
        ("jit call", lambda: jit_steady(settings)),
        ("compile time", lambda: compile_time(settings)),
        ("trace time", lambda: _trace.trace_figures(settings)),
        ("first call", lambda: first_call(settings)),
        ("place", lambda: _placement.place_batch(settings)),
        ("sharded_init memory", lambda: _init_memory.figures(smoke)),
        ("check_tree", lambda: _tree_figures.check_tree_figure(settings)),
        ("jit, tree", lambda: _tree_figures.jit_tree_figures(settings)),
        ("transformer step", lambda: _transformer.figures(settings)),
        ("field step", lambda: _field_step.figures(settings)),
        ("collectives", lambda: _collectives.figures(settings)),
        ("how the cost grows", lambda: _scaling.figures(settings)),
        ("preflight cost", lambda: _preflight_cost.figures(settings)),
        ("pod step, check_mesh='cpu'", lambda: _pod.figures(settings)),
    ]
    figures: list[dict] = []
    for label, step in steps:
        start = time.perf_counter()
        # The default, not a scope, which would hide the figures that set it.
        _timing.default_mode("check")
        result = step()
        figures.extend(result if isinstance(result, list) else [result])
        print(f"  {label}: {time.perf_counter() - start:.1f} s", file=progress)
    return figures


def notes(figures: list[dict]) -> str:
    lines = []
    for fig in figures:
        if "process_ratios" in fig:
            ratios = ", ".join(f"{r:.3f}" for r in fig["process_ratios"])
            lines.append(f"{fig['name']}: one ratio a process: {ratios}")
        if "extra_per_check_s" in fig:
            lines.append(f"{fig['name']}: +{fmt_s(fig['extra_per_check_s'])} per check")
        if "per_call_us" in fig:
            lines.append(_field_step.note(fig))
        elif "python_calls_over_plain" in fig:
            extra = fig["python_calls_over_plain"]
            lines.append(
                f"{fig['name']}: Python calls a call over plain: {extra}"
                + _call_cost.fixed_cost_note(fig)
            )
        if "plain_instancecheck_median_s" in fig:
            lines.append(
                f"{fig['name']}: plain jaxtyping check "
                f"{fmt_s(fig['plain_instancecheck_median_s'])}, floor "
                f"{fig['baseline_text']}"
            )
    return "\n" + "\n".join(lines) if lines else ""
