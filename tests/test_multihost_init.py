"""`sharded_init` in a real multi-host job: 2 processes x 4 CPU devices.

Each process runs `multihost_init_worker.py` (the verdicts are listed there); the
job, its bounded wait and its clean-up are those of `test_multihost.py`.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_multihost import _free_port, _stop, _worker_env


WORKER = Path(__file__).with_name("multihost_init_worker.py")
TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="uses POSIX process groups to clean up"
)


def test_two_process_sharded_init(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    env = _worker_env()
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
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
                time.sleep(2)  # let the other one report the same failure, then stop
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
        assert int(last[3]) >= 68, report  # every check ran, not just the first
