"""Starts the example as a job of several processes on this machine.

Each process gets 4 forced CPU devices and joins a `jax.distributed` job over
loopback (gloo collectives): a real multi-host job, as on a GPU cluster. Each
runs in its own process group, killed when the job ends or times out.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .__main__ import _FLAG


TIMEOUT_S = 240


def launch(processes: int, argv: list[str], timeout_s: float = TIMEOUT_S) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}=4"])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    logs = [tempfile.TemporaryFile() for _ in range(processes)]
    checkpoints = tempfile.TemporaryDirectory()  # shared by the processes
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "examples.transformer",
                *argv,
                "--processes",
                str(processes),
                "--worker",
                str(i),
                "--coordinator",
                address,
                "--checkpoint",
                checkpoints.name,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to kill
        )
        for i, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [w.poll() for w in workers]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                time.sleep(2)  # let the others report the same failure, then stop
                break
            time.sleep(0.1)
    finally:
        for worker in workers:
            if worker.poll() is None:
                try:
                    os.killpg(worker.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            worker.wait()
        checkpoints.cleanup()
    codes = [w.returncode for w in workers]
    for i, log in enumerate(logs):
        log.seek(0)
        print(f"--- process {i} (exit {codes[i]}) ---")
        print(log.read().decode(errors="replace").rstrip(), flush=True)
        log.close()
    if any(codes):
        print(f"processes exited with {codes}", file=sys.stderr)
        return 1
    return 0
