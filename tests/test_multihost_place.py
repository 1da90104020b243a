"""`jts.place` in a real multi-host job: 2 processes x 4 CPU devices over gloo.

The verdicts are asserted in `multihost_place_worker.py`; this test starts the
two processes (bounded by a timeout, always killed) and reads their reports.
"""

import subprocess
import sys
import time
from pathlib import Path

from .test_multihost import _free_port, _stop, _worker_env, PROCESSES, pytestmark


WORKER = Path(__file__).with_name("multihost_place_worker.py")
TIMEOUT_S = 240

__all__ = ["pytestmark"]


def test_place_across_two_processes(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    env = _worker_env()
    logs = [tmp_path / f"worker{i}.log" for i in range(PROCESSES)]
    processes: list[subprocess.Popen] = []
    try:
        for i, log in enumerate(logs):
            with open(log, "wb") as out:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-W", "error", str(WORKER), address, str(i)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=tmp_path,
                        start_new_session=True,  # its own process group, to kill
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in processes):
                break
            if any(p.poll() not in (None, 0) for p in processes):
                time.sleep(2)  # let the other one report too, then stop both
                break
            time.sleep(0.1)
    finally:
        for process in processes:
            _stop(process)

    outputs = [log.read_text(errors="replace") for log in logs]
    report = "\n".join(
        f"--- worker {i} (exit {p.returncode}) ---\n{text[-4000:]}"
        for i, (p, text) in enumerate(zip(processes, outputs))
    )
    for i, (process, text) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, report
        last = text.strip().splitlines()[-1].split()
        assert last[:3] == ["WORKER", str(i), "OK"], report
        assert int(last[3]) >= 60, report  # every check ran, not just the first
    counts = {text.strip().splitlines()[-1].split()[3] for text in outputs}
    assert len(counts) == 1, report
