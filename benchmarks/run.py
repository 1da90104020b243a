"""Overhead of jaxtyping_shard's checks, as ratios against same-run baselines.

    python benchmarks/run.py [--smoke] [--json PATH]

Prints a table and writes the same figures as JSON (default
`benchmarks/results.json`). A missed target is reported as MISS, not as a failure:
the exit status is nonzero only when the script itself breaks. Each figure is
explained in `benchmarks/README.md`.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import time


HERE = pathlib.Path(__file__).resolve().parent


def format_table(figures: list[dict]) -> str:
    header = ("figure", "candidate", "baseline", "ratio", "target", "verdict")
    rows = [header]
    for fig in figures:
        rows.append(
            (
                fig["name"],
                fig["candidate_text"],
                fig["baseline_text"],
                f"{fig['ratio']:.3f}" if fig["ratio"] is not None else "-",
                fig["target_text"],
                fig["verdict"],
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="few repeats: checks the script runs (CI), figures are rough",
    )
    parser.add_argument(
        "--json",
        default=str(HERE / "results.json"),
        metavar="PATH",
        help="where to write the figures (default: benchmarks/results.json)",
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(HERE))
    from _devices import force_cpu_devices  # beside this file, imports no JAX

    force_cpu_devices()
    # Imported here, after the device count is set: JAX reads XLA_FLAGS once.
    import _figures

    start = time.perf_counter()
    figures = _figures.run_all(smoke=args.smoke, progress=sys.stderr)
    elapsed = time.perf_counter() - start

    print(format_table(figures))
    print(_figures.notes(figures))
    print(f"\n{'smoke' if args.smoke else 'full'} mode, {elapsed:.1f} s")

    import jax
    import jaxtyping

    import jaxtyping_shard

    report = {
        "mode": "smoke" if args.smoke else "full",
        "seconds": round(elapsed, 2),
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "jaxtyping": _version("jaxtyping", jaxtyping),
            "beartype": _version("beartype"),
            "jaxtyping_shard": jaxtyping_shard.__version__,
            "devices": jax.device_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "figures": figures,
    }
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _version(name: str, module: object = None) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


if __name__ == "__main__":
    sys.exit(main())
