"""Figures 20-22: the reference program's pod step (about 7 B parameters, 32
layers, `examples/transformer/preflight.py`'s `POD`) preflighted with
`check_mesh="cpu"` on Auto axes (issue 36, item 5): the trace on the
`AbstractMesh`, a child process of forced CPU devices compiling the step (the
mesh folded beyond 2,048 devices: `report.check_mesh_method`), the report read
back. Wall clock of the whole preflight, the child's compile and peak resident
memory, this process's peak; from 256 to 4,096 devices and from 2 to 32 layers;
and the `AbstractMesh` path alone at 4,096 devices.

    python benchmarks/_pod.py [--smoke]     # one JSON line a measurement

`run.py` runs it in a fresh process (so that its own peak is the preflight's,
not the other figures'), and builds the figures from its lines.
"""

import argparse
import dataclasses
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any


HERE = pathlib.Path(__file__).resolve().parent
SHAPES = {256: (32, 8), 512: (64, 8), 1024: (128, 8), 2048: (256, 8), 4096: (512, 8)}


def measure(devices: int, layers: int, check: bool) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from examples.transformer import preflight as example
    from jaxtyping_shard._report import cpu_mesh

    children: list = []
    compile_in_child = cpu_mesh.compile_in_child

    def spied(*args: Any, **kwargs: Any) -> Any:
        children.append(compile_in_child(*args, **kwargs))
        return children[-1]

    cpu_mesh.compile_in_child = spied
    config = dataclasses.replace(example.POD, layers=layers)
    mesh = example.make_mesh(SHAPES[devices], "auto")
    start, cpu = time.perf_counter(), _cpu_s()
    report = example.preflight(config, mesh, check_mesh="cpu" if check else None)
    wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
    cpu_mesh.compile_in_child = compile_in_child
    child = children[0] if children else None
    return {
        "devices": devices,
        "layers": layers,
        "check_mesh": "cpu" if check else None,
        "method": report.check_mesh_method,
        "wall_s": round(wall, 2),
        # CPU seconds of this process and its child: what the load of a shared
        # machine does not stretch (the wall clock it does).
        "cpu_s": round(cpu, 2),
        "child_compile_s": None if child is None else round(child.seconds, 2),
        "child_peak_rss_mib": None if child is None else child.peak_rss_bytes >> 20,
        "parent_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
        "temporary_bytes": report.temporary_bytes,
        "peak_bytes": report.peak_bytes,
    }


def _cpu_s() -> float:
    own, child = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + child.ru_utime + child.ru_stime


def plan(smoke: bool) -> list[tuple[int, int, bool, int]]:
    """`(devices, layers, check_mesh="cpu", repeats)` of each measurement."""
    if smoke:
        return [(256, 2, True, 1), (4096, 2, False, 1)]
    return [
        *[(n, 32, True, 1) for n in (256, 512, 1024)],
        (2048, 32, True, 3),
        (4096, 32, True, 3),
        *[(2048, n, True, 1) for n in (2, 8)],
        (4096, 32, False, 3),
    ]


def run(smoke: bool) -> list[dict]:
    """Each measurement in a fresh process (its peak its own), in order."""
    rows = []
    for devices, layers, check, repeats in plan(smoke):
        for _ in range(repeats):
            argv = [
                sys.executable,
                __file__,
                "--one",
                f"{devices},{layers},{int(check)}",
            ]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def figures(settings: Any) -> list[dict]:
    rows = run(settings.smoke)

    def walls(devices: int, layers: int, check: bool = True) -> list[float]:
        return [
            r["wall_s"]
            for r in rows
            if (r["devices"], r["layers"], r["check_mesh"] is not None)
            == (devices, layers, check)
        ]

    def peak_mib(r: dict) -> int:  # the whole run: this process and its child
        return r["parent_peak_rss_mib"] + (r["child_peak_rss_mib"] or 0)

    result = []
    layers = max(r["layers"] for r in rows)
    checked = sorted({r["devices"] for r in rows if r["check_mesh"]})
    targets = {2048: 15.0, 4096: 60.0}  # the largest sizes' (the smoke's: none)
    for devices in [n for n in checked if n in targets] or checked[-1:]:
        times, target = walls(devices, layers), targets.get(devices)
        mine = [r for r in rows if r["devices"] == devices and r["check_mesh"]]
        result.append(_figure(devices, layers, times, target, mine, peak_mib))
    abstract = walls(4096, layers, False)
    result.append(
        _row(
            f"22. pod step, AbstractMesh only, 4,096 devices, {layers} layers",
            abstract,
            30.0,
            [r for r in rows if not r["check_mesh"]],
            peak_mib,
        )
    )
    grown = sorted({r["devices"] for r in rows if r["check_mesh"]})
    deep = sorted({r["layers"] for r in rows if r["devices"] == 2048})
    for name, sizes, of in (
        (
            f"21. pod step, check_mesh='cpu', 256 -> 4,096 devices, {layers} layers",
            grown,
            lambda n: walls(n, layers),
        ),
        (
            "21. pod step, check_mesh='cpu', 2,048 devices, 2 -> 32 layers",
            deep,
            lambda n: walls(2048, n),
        ),
    ):
        if len(sizes) > 2:
            result.append(
                _growth(name, sizes, [statistics.median(of(n)) for n in sizes])
            )
    result[-1]["rows"] = rows
    return result


def _growth(name: str, sizes: list, seconds: list) -> dict:
    from _scaling import exponent  # beside this file

    slope = exponent(sizes, seconds)
    return dict(
        name=name,
        what="fitted exponent of the median wall clock against the size",
        ratio=round(slope, 3),
        target=None,
        target_text="report",
        verdict="report",
        candidate_text=f"exponent {slope:.2f}",
        baseline_text=", ".join(f"{n:,}: {t:.1f} s" for n, t in zip(sizes, seconds)),
        exponent=round(slope, 3),
        sizes=sizes,
        seconds=seconds,
    )


def _figure(devices, layers, times, target, mine, peak_mib) -> dict:
    name = f"20. pod step, check_mesh='cpu', {devices:,} devices, {layers} layers"
    return _row(name, times, target, mine, peak_mib)


def _row(name, times, target, mine, peak_mib) -> dict:
    med = statistics.median(times)
    peak = max((peak_mib(r) for r in mine), default=None)
    return dict(
        name=name,
        what="wall clock of the whole preflight (min / median), peak RSS of the run",
        ratio=None if target is None else round(med / target, 3),
        target=target,
        target_text="report" if target is None else f"≤ {target:g} s",
        verdict="report" if target is None else ("PASS" if med <= target else "MISS"),
        candidate_text=f"{min(times):.1f} / {med:.1f} s",
        cpu_s=[r["cpu_s"] for r in mine],
        baseline_text="" if peak is None else f"peak {peak} MiB",
        seconds=list(times),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--one", default=None)
    args = parser.parse_args()
    if args.one:
        devices, layers, check = (int(v) for v in args.one.split(","))
        print(json.dumps(measure(devices, layers, bool(check))), flush=True)
    else:
        for row in run(args.smoke):
            print(json.dumps(row), flush=True)
