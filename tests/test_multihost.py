"""A real multi-host job: 2 processes x 4 CPU devices, and 4 x 2, arrays
spanning the processes.

Each process runs `multihost_worker.py`; together they form one JAX job over
loopback (gloo collectives), so the arrays checked are not fully addressable,
as on a TPU pod or a GPU cluster. The verdicts the workers assert are listed
there; the launcher is `tests/multihost.py`.
"""

import sys
from pathlib import Path

import pytest

from .multihost import assert_workers_ok, run_workers, worker_env, WorkerLog


WORKER = Path(__file__).with_name("multihost_worker.py")
_FLAG = "--xla_force_host_platform_device_count"

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="uses POSIX process groups to clean up"
)


def test_worker_env_forces_the_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {_FLAG}=8")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    env = worker_env(4)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", f"{_FLAG}=4"]
    assert "JAX_NUM_CPU_DEVICES" not in env
    assert worker_env(2)["XLA_FLAGS"].split()[-1] == f"{_FLAG}=2"


def test_assert_workers_ok_rejects_failed_or_short_runs():
    ok = [WorkerLog(i, 0, f"noise\nWORKER {i} OK 5\n") for i in range(2)]
    assert assert_workers_ok(ok, min_checks=5) == [5, 5]
    gloo = "[Gloo] Rank 1 is connected to 3 peer ranks.\n"  # after the line
    late = [ok[0], WorkerLog(1, 0, f"WORKER 1 OK 5\n{gloo}{gloo}")]
    assert assert_workers_ok(late, min_checks=5) == [5, 5]
    for logs in (
        [ok[0], WorkerLog(1, 1, "Traceback ...\nWORKER 1 OK 5")],  # exit status
        [ok[0], WorkerLog(1, None, "")],  # timed out
        [ok[0], WorkerLog(1, 0, "WORKER 0 OK 5")],  # another process's line
        [ok[0], WorkerLog(1, 0, "WORKER 1 OK 4")],  # a check did not run
        [ok[0], WorkerLog(1, 0, "noise\n")],  # no result line
        [ok[0], WorkerLog(1, 0, "WORKER 1 OK 5\nWORKER 1 OK 5")],  # two lines
    ):
        with pytest.raises(AssertionError, match="--- worker 1"):
            assert_workers_ok(logs, min_checks=5)
    uneven = [ok[0], WorkerLog(1, 0, "WORKER 1 OK 6")]  # the processes disagree
    with pytest.raises(AssertionError, match="--- worker 1"):
        assert_workers_ok(uneven, min_checks=5)
    assert assert_workers_ok(uneven, min_checks=5, same_count=False) == [5, 6]


# 2 processes x 4 devices, and 4 x 2 as JAX's own CPU multi-process tests run.
JOBS = [(2, 4), (4, 2)]


@pytest.mark.parametrize("processes, devices", JOBS)
def test_multi_process_job(tmp_path, processes, devices):
    logs = run_workers(
        WORKER, processes=processes, devices=devices, timeout_s=240, log_dir=tmp_path
    )
    assert len(logs) == processes
    assert_workers_ok(logs, min_checks=75)


def test_run_workers_stops_the_job_when_one_process_fails(tmp_path, monkeypatch):
    # Process 0 fails at once; process 1 would hang: it is killed, not awaited.
    monkeypatch.chdir(tmp_path)
    script = "worker.py"  # relative to the current directory, not to log_dir
    (tmp_path / "logs").mkdir()
    (tmp_path / script).write_text(
        "import sys, time\n"
        "print('args', sys.argv[1:], flush=True)\n"
        "if sys.argv[2] == '0':\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    logs = run_workers(script, ["extra"], timeout_s=60, log_dir=tmp_path / "logs")
    assert [log.returncode for log in logs] == [3, None]
    for i, log in enumerate(logs):
        assert f"'{i}', '2', 'extra']" in log.output
    with pytest.raises(AssertionError, match=r"worker 1 \(exit timeout\)"):
        assert_workers_ok(logs, min_checks=0)
