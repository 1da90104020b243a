"""`jts.place` in a real multi-host job: 2 processes x 4 CPU devices, and 4 x 2,
over gloo.

The verdicts are asserted in `multihost_place_worker.py`; the launcher
(`tests/multihost.py`) starts the two processes, bounded by a timeout and always
killed, and this test reads their reports.
"""

import sys
from pathlib import Path

import pytest

from .multihost import assert_workers_ok, run_workers


WORKER = Path(__file__).with_name("multihost_place_worker.py")

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="uses POSIX process groups to clean up"
)


@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_place_across_processes(tmp_path, processes, devices):
    logs = run_workers(
        WORKER, processes=processes, devices=devices, timeout_s=240, log_dir=tmp_path
    )
    assert len(logs) == processes
    assert_workers_ok(logs, min_checks=75 if processes == 2 else 55)
