"""`sharded_init` in a real multi-host job: 2 processes x 4 CPU devices, and 4 x 2.

Each process runs `multihost_init_worker.py` (the verdicts are listed there); the
launcher, its bounded wait and its clean-up are `tests/multihost.py`.
"""

import sys
from pathlib import Path

import pytest

from .multihost import assert_workers_ok, run_workers


WORKER = Path(__file__).with_name("multihost_init_worker.py")

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="uses POSIX process groups to clean up"
)


@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_multi_process_sharded_init(tmp_path, processes, devices):
    logs = run_workers(
        WORKER, processes=processes, devices=devices, timeout_s=240, log_dir=tmp_path
    )
    assert len(logs) == processes
    # Every check ran, in every process (fewer shards a process on 4 x 2).
    assert_workers_ok(logs, min_checks=138 if processes == 2 else 96)
