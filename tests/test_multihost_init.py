"""`sharded_init` in a real multi-host job: 2 processes x 4 CPU devices.

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


def test_two_process_sharded_init(tmp_path):
    logs = run_workers(WORKER, log_dir=tmp_path)
    assert_workers_ok(logs, min_checks=135)  # every check ran, in both
