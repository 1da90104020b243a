"""Figure 12: a training step of the transformer example, checks on / off / no library.

`examples/transformer`'s `train_step` (`jts.jit` with shardings from the
annotations, every check on) against the same step in mode "off", and against
the same Python function compiled by plain `jax.jit` with shardings written by
hand (taken from the placed arrays): steady-state calls, interleaved, 303
batches a side in full mode. A second plain `jax.jit` of the same function,
timed alongside, gives the noise floor: how far apart two equal sides come out
on this machine. Beside it, the first call (trace + compile + run, caches
cleared) of the checked step against plain `jax.jit` in mode "off".
"""

import inspect
import pathlib
import statistics
import sys
from typing import Any

import jax
from _call_cost import (  # beside this file
    calls_per_call,
    compare,
    guard_calls,
    guard_us,
    host_cost_us,
    program,
)
from _timing import (
    default_mode,
    figure,
    interleaved,
    judge_fixed_cost,
    one_shots,
    Settings,
    timed,
)
from jax.sharding import NamedSharding, PartitionSpec

import jaxtyping_shard as jts


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from examples.transformer import train  # noqa: E402
from examples.transformer.layout import RULES  # noqa: E402
from examples.transformer.model import Config  # noqa: E402


def _setup(kind: str, config: Config = Config()) -> tuple:
    mesh = train.make_mesh((4, 2), kind)
    with jax.set_mesh(mesh), jts.axis_rules(RULES["fsdp_tp"]):
        params, opt = train.init(config, mesh)
        batch = train.load_batch(0, config, mesh)
    return mesh, (params, opt, batch)


def _plain(args: tuple) -> Any:
    """The step's own function under plain `jax.jit`, shardings by hand."""
    raw = inspect.unwrap(train.train_step)  # below jts.jit and its boundary checks
    shardings = jax.tree.map(lambda x: x.sharding, args)
    return jax.jit(raw, in_shardings=shardings, out_shardings=shardings[:2] + (None,))


def _wrong(mesh: Any, args: tuple) -> bool:
    """The checks are live: a replicated batch is refused."""
    params, opt, batch = args
    everywhere = NamedSharding(mesh, PartitionSpec())
    replicated = jax.tree.map(lambda x: jax.device_put(x, everywhere), batch)
    try:
        train.train_step(params, opt, replicated)
    except jts.ShardingTypeCheckError:
        return True
    return False


def figures(settings: Settings) -> list[dict]:
    kinds = ("explicit",) if settings.smoke else ("explicit", "auto")
    return [fig for kind in kinds for fig in _for_mesh(kind, settings)]


def _for_mesh(kind: str, settings: Settings) -> list[dict]:
    # --smoke (CI): one block, no first-call pair; it shows the figure runs.
    mesh, args = _setup(kind, Config(layers=1) if settings.smoke else Config())
    name = f"12. transformer step, {kind.capitalize()}"
    with jax.set_mesh(mesh), jts.axis_rules(RULES["fsdp_tp"]):
        plain, again = _plain(args), _plain(args)
        step = train.train_step

        def checked() -> Any:
            return jax.block_until_ready(step(*args))

        def bare() -> Any:
            return jax.block_until_ready(plain(*args))

        def bare_again() -> Any:  # the noise floor: plain against itself
            return jax.block_until_ready(again(*args))

        # Mode off is set before each of its batches, untimed, as a program run
        # with JAXTYPING_SHARD_MODE=off has it: a `with set_mode("off")` around
        # each call would time JAX's thread-local config switch (about 50 µs a
        # call here, for plain `jax.jit` as much as for `jts.jit`).
        previous = jts.get_mode()
        try:
            times = interleaved(
                {
                    "plain": bare,
                    "checked": checked,
                    "off": checked,
                    "again": bare_again,
                },
                settings,
                setups={
                    "plain": lambda: default_mode("check"),
                    "checked": lambda: default_mode("check"),
                    "off": lambda: default_mode("off"),
                    "again": lambda: default_mode("check"),
                },
                repeats=settings.repeats if settings.smoke else 3 * settings.repeats,
            )
        finally:
            jts.set_mode(previous)
        live = _wrong(mesh, args)
        # What a call does beyond plain's, in each mode: Python calls, the
        # speculation's guard, and the compiled program (full run only).
        work = {}
        plain_program = None if settings.smoke else program(plain, args)
        for key, mode in (("checked", "check"), ("off", "off")):
            default_mode(mode)
            try:
                extra = calls_per_call(step, args) - calls_per_call(plain, args)
                host = host_cost_us(
                    extra,
                    type(step) is type(plain),
                    guard_us(step, args),
                    guard_calls(step, args),
                )
                same = (
                    "not compared"
                    if plain_program is None
                    else compare(plain_program, program(step, args))
                )
            finally:
                jts.set_mode(previous)
            work[key] = dict(host=host, same=same, extra=extra)
        step_s = statistics.median(times["plain"])

        def first(checked_step: bool) -> float:
            if checked_step:
                fresh = jts.jit(
                    inspect.unwrap(train.train_step),
                    in_shardings="annotations",
                    out_shardings="annotations",
                )
                return timed(lambda: jax.block_until_ready(fresh(*args)))
            fresh = _plain(args)
            with jts.set_mode("off"):
                return timed(lambda: jax.block_until_ready(fresh(*args)))

        repeats = 0 if settings.smoke else 5
        shots = one_shots(
            {"plain": lambda: first(False), "checked": lambda: first(True)}, repeats
        )
    what = "train_step of examples/transformer (FSDP + TP, 4x2 mesh)"
    first_call = []
    if repeats:
        first_call.append(
            figure(
                name + ", first call",
                f"trace + compile + run of the {what}, caches cleared: jts.jit, "
                "checks on / plain jax.jit in mode off",
                shots["checked"],
                shots["plain"],
                None,
                "report",
                live=live,
            )
        )
    steady = []
    for key, text in (
        ("checked", "jts.jit, checks on / plain jax.jit, shardings by hand"),
        ("off", "jts.jit in mode off / plain jax.jit"),
    ):
        row = figure(
            name + (", off" if key == "off" else ""),
            f"steady-state {what}: {text}",
            times[key],
            times["plain"],
            1.01,
            "≤ 1.01",
            live=live,
            python_calls_over_plain=work[key]["extra"],
            same_program_as_plain=work[key]["same"],
        )
        steady.append(
            judge_fixed_cost(row, work[key]["host"], step_s, work[key]["same"])
        )
    return [
        *steady,
        figure(
            name + ", noise floor",
            f"steady-state {what}: a second plain jax.jit of it / plain jax.jit "
            "(the same program: how far apart two equal sides come out)",
            times["again"],
            times["plain"],
            None,
            "report",
            live=live,
        ),
        *first_call,
    ]
