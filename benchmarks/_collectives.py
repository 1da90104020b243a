"""Figure 13: `jts.collectives` of the transformer example's step, against its compile.

The step (`examples/transformer`, FSDP + TP rules, 4x2 mesh; `--smoke`: one
block, Explicit only), for abstract arguments: its compile with JAX's caches
cleared (the baseline: what any report must wait for once), against the report
with the step already compiled (the candidate: the report's own cost beyond the
compile, which must stay under 1 s, and compile nothing). Beside it, the cold
report (caches cleared: one compile and the report) against the same compile.
"""

import pathlib
import statistics
import sys
import time

import jax
from _timing import figure, one_shots, Settings, timed

import jaxtyping_shard as jts


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from examples.transformer import collectives as reference, train  # noqa: E402
from examples.transformer.layout import RULES  # noqa: E402
from examples.transformer.model import Config  # noqa: E402


BUDGET_S = 1.0
COMPILED = "/jax/core/compile/backend_compile_duration"
_compiles = [0]  # XLA compiles so far, counted from JAX's compile event


def _count(event: str, duration: float, **kwargs) -> None:
    _compiles[0] += event == COMPILED


jax.monitoring.register_event_duration_secs_listener(_count)


def figures(settings: Settings) -> list[dict]:
    kinds = ("explicit",) if settings.smoke else ("explicit", "auto")
    return [fig for kind in kinds for fig in _for_mesh(kind, settings)]


def _for_mesh(kind: str, settings: Settings) -> list[dict]:
    config = Config(layers=1) if settings.smoke else Config()
    mesh = train.make_mesh((4, 2), kind)
    name = f"13. collectives of the transformer step, {kind.capitalize()}"
    what = "jts.collectives of examples/transformer's train_step (FSDP + TP, 4x2)"
    step = train.train_step
    with jax.set_mesh(mesh), jts.axis_rules(RULES["fsdp_tp"]):
        args = reference.arguments(config, mesh)
        shots = one_shots(
            {
                "compile": lambda: timed(lambda: step.lower(*args).compile()),
                "cold": lambda: timed(lambda: jts.collectives(step, *args)),
            },
            1 if settings.smoke else 5,
        )
        report = jts.collectives(step, *args)  # compiled now
        before = _compiles[0]
        warm = [
            _warm(lambda: jts.collectives(step, *args))
            for _ in range(settings.one_shot_repeats)
        ]
        warm_compiles = _compiles[0] - before
    live = report.count > 0 and warm_compiles == 0
    compile_s = statistics.median(shots["compile"])
    return [
        figure(
            name,
            f"{what}, the step already compiled / its compile (caches cleared); "
            f"target: under {BUDGET_S:.0f} s beyond the compile, no compile",
            warm,
            shots["compile"],
            BUDGET_S / compile_s,
            f"report ≤ {BUDGET_S:.0f} s",
            live=live,
            report_s=statistics.median(warm),
            compiles_in_warm_reports=warm_compiles,
            collectives=report.count,
        ),
        figure(
            name + ", cold",
            f"{what} with caches cleared (one compile and the report) / the compile",
            shots["cold"],
            shots["compile"],
            None,
            "report",
            live=live,
        ),
    ]


def _warm(run) -> float:
    """Seconds of one call, caches kept (unlike `_timing.timed`)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
