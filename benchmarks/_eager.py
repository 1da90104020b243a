"""Figures 1 and 2: an eager call under `jaxtyped(typechecker=beartype)`, sharded
annotations / plain jaxtyping, each timed in several fresh processes.

Why processes. The two sides differ by a few hundred machine instructions in a
call of about 30 µs, and one process's ratio carries a bias of its own: where
the two functions, their classes and their code land in memory (caches, branch
predictors) moves it by 1-3% on this VM, the same way for every repeat of that
process, so repeats within it cannot average it out. Each process times every
variant (interleaved batches, as every other figure); the figure is the median
of the processes' ratios, and their range is printed below the table.

    python benchmarks/_eager.py [--smoke]    # one process's times, as JSON
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Any


HERE = pathlib.Path(__file__).resolve().parent
# (arguments, mode): "off" is the process default (`JAXTYPING_SHARD_MODE=off`,
# set untimed before each batch); "off in a scope" a `with set_mode("off")`.
VARIANTS = (
    (1, "check"),
    (8, "check"),
    (1, "off"),
    (8, "off"),
    (1, "off in a scope"),
    (8, "off in a scope"),
)
# Figure 1 (mode check), figure 2 (mode off) and 2s (off in a scope).
TARGETS = {
    "check": ("1. eager, {} arg(s)", 1.03, "≤ 1.03"),
    "off": ("2. eager, {} arg(s), off", 1.02, "1.00 (≤ 1.02)"),
    "off in a scope": ("2s. eager, {} arg(s), off in a scope", 1.05, "≤ 1.05"),
}
PROCESSES = 5  # 1 in --smoke
CHILD_TIMEOUT_S = 600


def _key(n_args: int, mode: str) -> str:
    return f"{n_args} {mode}"


# One process: the timings (run as a script).


def _checked(n_args: int, annotations: list[Any], returns: Any) -> Any:
    from beartype import beartype
    from jaxtyping import jaxtyped

    # Fresh function objects, so that no two variants share jaxtyping's caches.
    if n_args == 1:

        def f(x0):
            return x0

    else:

        def f(x0, x1, x2, x3, x4, x5, x6, x7):
            return x0

    f.__annotations__ = {f"x{i}": a for i, a in enumerate(annotations)}
    f.__annotations__["return"] = returns
    return jaxtyped(typechecker=beartype)(f)


def _times(n_args: int, mode: str, smoke: bool) -> dict:
    import _timing  # beside this file
    import jaxtyping
    from _setup import (
        make_mesh,
        place,
        PLAIN,
        raises,
        sharded,
        SPECS,
    )  # beside this file
    from jax.sharding import PartitionSpec as P

    import jaxtyping_shard as jts

    mesh = make_mesh("explicit")
    specs = SPECS[:n_args]
    args = tuple(place(mesh, spec) for spec in specs)
    ours = _checked(n_args, [sharded(s) for s in specs], sharded(specs[0]))
    plain = _checked(n_args, [PLAIN] * n_args, PLAIN)
    # Mis-sharded first argument: refused in mode check, let through in mode off.
    wrong = (place(mesh, P("model", None)),) + args[1:]
    stmts = {"plain": lambda: plain(*args), "ours": lambda: ours(*args)}
    settings = _timing.Settings(smoke)
    _timing.default_mode("check")
    if mode == "check":
        times = _timing.interleaved(stmts, settings)
        live = raises(lambda: ours(*wrong), jaxtyping.TypeCheckError)
    elif mode == "off":
        off = {name: lambda: _timing.default_mode("off") for name in stmts}
        times = _timing.interleaved(stmts, settings, setups=off)
        live = not raises(lambda: ours(*wrong))
    else:
        with jts.set_mode("off"):
            times = _timing.interleaved(stmts, settings)
            live = not raises(lambda: ours(*wrong))
    _timing.default_mode("check")
    return {"ours": times["ours"], "plain": times["plain"], "live": live}


def _child(smoke: bool) -> None:
    sys.path.insert(0, str(HERE))
    from _devices import force_cpu_devices  # beside this file

    force_cpu_devices()
    out = {_key(n, mode): _times(n, mode, smoke) for n, mode in VARIANTS}
    print(json.dumps(out))


# The figures (run by `_figures.run_all`).


def _one_process(smoke: bool) -> dict:
    env = dict(os.environ, JAXTYPING_SHARD_MODE="check")
    command = [sys.executable, str(HERE / "_eager.py")] + (["--smoke"] if smoke else [])
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(settings: Any) -> list[dict]:
    from _timing import figure, paired_ratio  # beside this file

    processes = 1 if settings.smoke else PROCESSES
    runs = [_one_process(settings.smoke) for _ in range(processes)]
    out = []
    for n_args, mode in VARIANTS:
        per = [run[_key(n_args, mode)] for run in runs]
        ratios = [paired_ratio(p["ours"], p["plain"]) for p in per]
        name, target, text = TARGETS[mode]
        out.append(
            figure(
                name.format(n_args),
                f"call of f({n_args} annotated args) -> annotated, jaxtyped(beartype), "
                f"mode {mode!r}: sharded annotations / plain jaxtyping, median of "
                f"{len(runs)} processes",
                [t for p in per for t in p["ours"]],
                [t for p in per for t in p["plain"]],
                target,
                text,
                ratio=statistics.median(ratios),
                live=all(p["live"] for p in per),
                process_ratios=[round(r, 4) for r in ratios],
            )
        )
    return out


if __name__ == "__main__":
    _child(smoke="--smoke" in sys.argv[1:])
