"""A real multi-host job: 2 processes x 4 CPU devices, arrays spanning both.

Each process runs `multihost_worker.py`; together they form one JAX job over
loopback (gloo collectives), so the arrays checked are not fully addressable,
as on a TPU pod or a GPU cluster. The verdicts the workers assert are listed
there.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


WORKER = Path(__file__).with_name("multihost_worker.py")
PROCESSES = 2
TIMEOUT_S = 180
_FLAG = "--xla_force_host_platform_device_count"

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="uses POSIX process groups to clean up"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """The parent's environment with 4 CPU devices, not the 8 pytest forced."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}=4"])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    root = str(WORKER.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def test_worker_env_forces_four_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {_FLAG}=8")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    env = _worker_env()
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", f"{_FLAG}=4"]
    assert "JAX_NUM_CPU_DEVICES" not in env


def test_two_process_job(tmp_path):
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
        assert int(last[3]) >= 70, report  # every check ran, not just the first
    counts = {text.strip().splitlines()[-1].split()[3] for text in outputs}
    assert len(counts) == 1, report
