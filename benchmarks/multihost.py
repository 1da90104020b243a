"""A multi-host job on this machine, on demand (not in CI): 8 processes x 8 CPU
devices by default, each timing `sharded_init`, `check_tree` and `place` on a
mesh spanning all 64 devices, with each process's `place` input and result
verified as the tests verify them.

    python benchmarks/multihost.py [--processes 8] [--devices 8] [--timeout 600]

Each process takes about 1 GiB; the launcher (`tests/multihost.py`) bounds the
wait and kills every process group at the end. Prints one row per process and
the medians; exits nonzero if a process failed or a verification did not hold.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.multihost import assert_workers_ok, report, run_workers  # noqa: E402


COLUMNS = ("sharded_init_s", "check_tree_s", "place_s", "place_checksum_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8, help="per process")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    logs = run_workers(
        HERE / "multihost_worker.py",
        processes=args.processes,
        devices=args.devices,
        timeout_s=args.timeout,
    )
    try:
        assert_workers_ok(logs, min_checks=1)
    except AssertionError:
        print(report(logs), file=sys.stderr)
        return 1
    rows = [
        json.loads(line[len("TIMES ") :])
        for log in logs
        for line in log.output.splitlines()
        if line.startswith("TIMES ")
    ]
    first = rows[0]
    print(
        f"{first['processes']} processes x {first['devices'] // first['processes']} "
        f"CPU devices ({first['devices']} in all), {first['leaves']} parameter "
        f"leaves, {first['local_batch_bytes']} bytes of batch a process"
    )
    print("process  " + "  ".join(f"{c:>16}" for c in COLUMNS))
    for row in rows:
        cells = "  ".join(f"{row[c] * 1e3:13.1f} ms" for c in COLUMNS)
        print(f"{row['process']:>7}  {cells}")
    medians = "  ".join(
        f"{statistics.median(r[c] for r in rows) * 1e3:13.1f} ms" for c in COLUMNS
    )
    print(f"{'median':>7}  {medians}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
