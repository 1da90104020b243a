"""Runs each test of the given files alone, one process per test, and names
those that fail alone: a test that passes in the suite only after another
(a warm cache, a compile, a global left behind) fails here.

    python .ci/run_alone.py tests/test_caches.py tests/test_collectives.py

Too slow for CI (a process per test); CI runs the suite at the newest releases
in reverse order instead (`JAXTYPING_SHARD_TEST_ORDER=reverse`, see
tests/conftest.py), which puts every test before those it followed.
"""

import subprocess
import sys


def node_ids(files: list[str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         *files],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if "::" in line]


def main(files: list[str]) -> int:
    failed = []
    for node in node_ids(files):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly",
             node],
            capture_output=True, text=True,
        )  # fmt: skip
        print(("ok    " if run.returncode == 0 else "ALONE FAILS ") + node, flush=True)
        if run.returncode != 0:
            failed.append(node)
    print(f"{len(failed)} fail alone" + "".join(f"\n  {n}" for n in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
