"""Figures 17 and 18: what `jts.preflight` of the transformer step costs, from 8
to 4,096 devices and from 2 to 64 layers. Imported after the device count is set.

Each preflight traces the step afresh (it never reuses a cached trace), so each
sample is one preflight; the baseline is the step's trace alone, in mode off,
with the same abstract inputs on the same mesh, caches cleared.
"""

import dataclasses
import math
import pathlib
import statistics
import sys
from typing import Any

import jax
from _scaling import cpu_timed, growth, python_calls  # beside this file
from _timing import figure, one_shots, Settings

import jaxtyping_shard as jts


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from examples.transformer import preflight as _example, train as _train  # noqa: E402
from examples.transformer.layout import RULES  # noqa: E402
from examples.transformer.model import Config  # noqa: E402


# Divisible by the 512 `data` devices where FSDP shards (embed; the batch twice,
# for its 2 micro-batches).
SMALL = Config(vocab=64, embed=512, heads=8, head_dim=8, mlp=64, seq=16, batch=1024)


def _preflight_times(config: Config, shape: tuple, repeats: int) -> tuple:
    """`(median seconds, python calls, one_shots' times)` of one preflight."""
    mesh = _example.make_mesh(shape)
    inputs = _example.abstract_inputs(config, mesh)
    with jts.axis_rules(RULES["fsdp_tp"]):

        def preflight() -> Any:
            return jts.preflight(_train.train_step, *inputs, mesh=mesh)

        def ours() -> float:
            return cpu_timed(preflight)

        def plain() -> float:  # what tracing the step alone costs, checks off
            with jts.set_mode("off"), jax.sharding.use_abstract_mesh(mesh):
                return cpu_timed(lambda: _train.train_step.trace(*inputs))

        times = one_shots({"plain": plain, "ours": ours}, repeats)
        calls = python_calls(preflight)
    return statistics.median(times["ours"]), calls, times


def preflight_growth(settings: Settings) -> list[dict]:
    repeats = 1 if settings.smoke else 3
    meshes = (
        [(2, 4), (512, 8)] if settings.smoke else [(2, 4), (8, 8), (64, 8), (512, 8)]
    )
    devices = [math.prod(s) for s in meshes]
    two = dataclasses.replace(SMALL, layers=1 if settings.smoke else 2)
    by_mesh = [_preflight_times(two, shape, repeats) for shape in meshes]
    layers = [1, 2] if settings.smoke else [2, 8, 32, 64]
    by_layers = [
        _preflight_times(dataclasses.replace(SMALL, layers=n), (512, 8), repeats)
        for n in layers
    ]
    mesh_fig = growth(
        "17. preflight, 8 -> 4,096 devices",
        f"jts.preflight of the transformer step ({two.layers} layers)",
        "device",
        devices,
        [t for t, _, _ in by_mesh],
        [c for _, c, _ in by_mesh],
    )
    slope = mesh_fig["exponent"]
    mesh_fig.update(
        target=0.1,
        target_text="exponent ≤ 0.1",
        verdict=("PASS" if slope <= 0.1 else "MISS")
        if mesh_fig["calls_exponent"] <= 0.01
        else "MISS (calls)",
    )
    times = by_layers[-1][2]
    return [
        mesh_fig,
        growth(
            "18. preflight, layers",
            "jts.preflight of the transformer step on 512 x 8 devices",
            "layer",
            layers,
            [t for t, _, _ in by_layers],
            [c for _, c, _ in by_layers],
        ),
        figure(
            f"18. preflight, {layers[-1]} layers / trace",
            "jts.preflight / the step's trace alone in mode off (same mesh, inputs)",
            times["ours"],
            times["plain"],
            None,
            "report",
        ),
    ]


def figures(settings: Settings) -> list[dict]:
    return preflight_growth(settings)
