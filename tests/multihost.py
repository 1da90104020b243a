"""Real multi-host JAX jobs on one machine: N processes x M forced CPU devices.

The launcher side (in a test):

    from .multihost import assert_workers_ok, run_workers

    def test_something(tmp_path):
        logs = run_workers(Path(__file__).with_name("my_worker.py"), ["extra"])
        assert_workers_ok(logs, min_checks=10)

The worker side (a script, run as `python my_worker.py ADDRESS ID COUNT [ARGS]`):

    from tests.multihost import Checks, join_job

    def main() -> int:
        process_id, args = join_job()  # before any other JAX call
        import jaxtyping_shard as jts
        check = Checks(process_id)
        check(jax.device_count() == 8, "all devices seen")
        return check.done()  # prints `WORKER <id> OK <checks>`, shuts down

    if __name__ == "__main__":
        sys.exit(main())

Several processes on one machine form a real multi-host job (arrays that are not
fully addressable, cross-process collectives through gloo on loopback), as on a
TPU pod or a GPU cluster. Not collected by pytest (no `test_` prefix).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent  # on the workers' PYTHONPATH
_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True)
class WorkerLog:
    """What one worker process left: its exit status and its output."""

    process_id: int
    returncode: int | None  # None: still running at the timeout (then killed)
    output: str


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices: int = 4) -> dict[str, str]:
    """This environment with `devices` CPU devices (not pytest's 8), CPU only, and
    the repository root on `PYTHONPATH` (so workers import `tests.multihost`)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}={devices}"])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    return env


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the worker and its children
        except ProcessLookupError:
            pass
    process.wait()


def run_workers(
    worker: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    processes: int = 2,
    devices: int = 4,
    timeout_s: float = 180,
    log_dir: str | os.PathLike | None = None,
) -> list[WorkerLog]:
    """Runs one job of `processes` copies of the script `worker` and waits for it.

    Each copy runs as `python -W error WORKER ADDRESS PROCESS_ID PROCESSES *args`
    in its own process group, with `devices` forced CPU devices (`worker_env`);
    the worker joins the job with `join_job()`. Waits at most `timeout_s` seconds
    in all; once one process fails, the others get 2 s to report, then every
    process still running is killed (its whole group), whatever happens.

    **Arguments:** `worker`: the script's path (relative to the current
    directory, or absolute); `args`: extra command-line
    arguments, the same for every process; `log_dir`: where the output goes
    (`workerN.log`; a temporary directory, deleted afterwards, by default). It is
    also the workers' working directory.

    **Returns:** one `WorkerLog` per process, in process order. Nothing is
    asserted here: pass the logs to `assert_workers_ok` (or read them).
    """
    if sys.platform == "win32":  # pragma: no cover
        raise RuntimeError("run_workers uses POSIX process groups to clean up")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(log_dir if log_dir is not None else scratch)
        address = f"127.0.0.1:{free_port()}"
        env = worker_env(devices)
        paths = [directory / f"worker{i}.log" for i in range(processes)]
        script = str(Path(worker).resolve())  # the workers run in `directory`
        started: list[subprocess.Popen] = []
        try:
            for i, path in enumerate(paths):
                command = [sys.executable, "-W", "error", script, address]
                command += [str(i), str(processes), *map(str, args)]
                with open(path, "wb") as out:
                    started.append(
                        subprocess.Popen(
                            command,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=env,
                            cwd=directory,
                            start_new_session=True,  # its own group, to kill
                        )
                    )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all(p.poll() is not None for p in started):
                    break
                if any(p.poll() not in (None, 0) for p in started):
                    time.sleep(2)  # let the others report the same failure
                    break
                time.sleep(0.1)
            codes = [p.poll() for p in started]  # None: timed out
        finally:
            for process in started:
                _stop(process)
        return [
            WorkerLog(i, code, path.read_text(errors="replace"))
            for i, (code, path) in enumerate(zip(codes, paths))
        ]


def report(logs: Sequence[WorkerLog], tail: int = 4000) -> str:
    """Every worker's exit status and the last `tail` characters of its output."""
    return "\n".join(
        f"--- worker {log.process_id} (exit "
        f"{'timeout' if log.returncode is None else log.returncode}) ---\n"
        f"{log.output[-tail:]}"
        for log in logs
    )


def assert_workers_ok(
    logs: Sequence[WorkerLog], min_checks: int, same_count: bool = True
) -> list[int]:
    """Asserts every worker exited 0 with one `WORKER <id> OK <n>` line, `n >=
    min_checks` (every check ran, not just the first) and, if `same_count`, the
    same `n` in every process. Returns the counts; the message shows all logs.

    The line need not be the last: gloo's C++ logging (`[Gloo] Rank 0 is
    connected ...`) reaches the same file unsynchronised with Python's output, and
    can come after it. A failure after the line still shows in the exit status."""
    counts = []
    for log in logs:
        assert log.returncode == 0, report(logs)
        results = [
            line.split()
            for line in log.output.splitlines()
            if line.startswith("WORKER ")
        ]
        assert len(results) == 1, report(logs)
        last = results[0]
        assert last[:3] == ["WORKER", str(log.process_id), "OK"], report(logs)
        counts.append(int(last[3]))
        assert counts[-1] >= min_checks, report(logs)
    if same_count:
        assert len(set(counts)) == 1, report(logs)
    return counts


def join_job(argv: Sequence[str] | None = None) -> tuple[int, list[str]]:
    """Joins the job `run_workers` started: `argv` (default `sys.argv[1:]`) is
    `ADDRESS PROCESS_ID PROCESSES [ARGS...]`. Sets gloo CPU collectives and calls
    `jax.distributed.initialize`, with bounded timeouts; call it before any other
    JAX computation. Returns this process's id and the extra arguments."""
    import jax

    argv = list(sys.argv[1:] if argv is None else argv)
    address, process_id, processes = argv[0], int(argv[1]), int(argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address,
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=30,
    )
    assert jax.process_count() == processes, jax.process_count()
    assert jax.process_index() == process_id, jax.process_index()
    return process_id, argv[3:]


class Checks:
    """Counts a worker's verdicts: `check(ok, what)` raises `AssertionError`
    naming the process when `ok` is false; `done()` reports the count."""

    def __init__(self, process_id: int):
        self.process_id = process_id
        self.count = 0

    def __call__(self, ok: bool, what: str) -> None:
        if not ok:
            raise AssertionError(f"process {self.process_id}: {what}")
        self.count += 1

    def raises(self, error_type, fun, *args, what: str) -> str:
        """Calls `fun(*args)`, which must raise `error_type`; returns the error's
        text with its causes', for the caller to match fragments in."""
        try:
            fun(*args)
        except error_type as error:
            self(True, what)
            text, cause = [], error
            while cause is not None:
                text.append(str(cause))
                cause = cause.__cause__
            return "\n".join(text)
        raise AssertionError(
            f"process {self.process_id}: {what}: no {error_type.__name__} raised"
        )

    def done(self) -> int:
        """Prints `WORKER <id> OK <count>` (what `assert_workers_ok` reads), shuts
        the job down, and returns 0 for `sys.exit`."""
        import jax

        print(f"WORKER {self.process_id} OK {self.count}", flush=True)
        jax.distributed.shutdown()
        return 0
