"""JAX's persistent compilation cache: a checked program hits it as an unchecked
one does, and a hit never skips a check that fails.

Two processes share one cache directory (`persistent_cache_worker.py`): run 1
fills it, run 2 finds it filled. A program is found there by a key that hashes
it, so the checks' custom calls must be the same bytes in every process; and a
program found there is not compiled, so XLA never calls its checks back: only
programs whose checks all passed may be written.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


WORKER = Path(__file__).with_name("persistent_cache_worker.py")
ROOT = Path(__file__).resolve().parent.parent
_FLAG = "--xla_force_host_platform_device_count"


def _run(cache: Path, run: int, seed: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}=8"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, str(WORKER), str(cache), str(run), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [s for s in done.stdout.splitlines() if s.startswith("REPORT ")]
    assert done.returncode == 0 and len(lines) == 1, (
        done.stdout[-3000:] + done.stderr[-6000:]
    )
    return json.loads(lines[0][len("REPORT ") :])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    cache = tmp_path_factory.mktemp("jax_cache")
    first = _run(cache, 1, seed=1)
    assert any(cache.iterdir()), "run 1 wrote nothing to the persistent cache"
    return first, _run(cache, 2, seed=2)


CACHED = ("unchecked", "checked", "checked_warn_mode", "scan", "vmapped")


def test_run_1_compiles_everything(runs):
    first, _ = runs
    assert not any(r["hit"] for r in first["scenarios"].values())


@pytest.mark.parametrize("name", CACHED)
def test_a_checked_program_hits_as_an_unchecked_one(runs, name):
    first, second = runs
    assert first["scenarios"][name]["outcome"] == "pass"
    assert second["scenarios"][name] == {
        "outcome": "pass",
        "hit": True,
        "not_cached_warning": False,
    }
    assert second["scenarios"]["unchecked"]["hit"]  # the baseline hits too


def test_a_failing_check_fails_in_every_process(runs):
    # Mode "check": the compile fails before JAX writes it; run 2 compiles again.
    for report in runs:
        assert report["scenarios"]["failing"] == {
            "outcome": "error",
            "hit": False,
            "not_cached_warning": False,
        }


def test_a_failing_check_warns_in_every_process(runs):
    # Mode "warn": the program runs, is not written (JAX's warning names why),
    # and run 2 compiles it again and warns again.
    for report in runs:
        assert report["scenarios"]["failing_warn_mode"] == {
            "outcome": "warned",
            "hit": False,
            "not_cached_warning": True,
        }


def test_the_key_holds_the_resolved_annotation(runs):
    # One program, its logical annotation resolved by another rules table in run
    # 2: run 1's cached pass must not answer for run 2's failing check.
    first, second = runs
    assert first["scenarios"]["rules"]["outcome"] == "pass"
    assert second["scenarios"]["rules"] == {
        "outcome": "error",
        "hit": False,
        "not_cached_warning": False,
    }


def test_differential_random_annotations_of_one_program(runs):
    # Each worker checks every verdict against `Sharding.is_equivalent_to`; here:
    # a pair hits exactly when it passed before (in run 1, or earlier in run 2).
    first, second = runs
    assert [c["outcome"] for c in second["replayed"]] == [
        c["outcome"] for c in first["replayed"]
    ]
    passed = set()
    for case in first["replayed"]:
        assert case["hit"] == (tuple(case["case"]) in passed)
        if case["outcome"] == "pass":
            passed.add(tuple(case["case"]))
    for case in second["replayed"] + second["own"]:
        assert case["hit"] == (tuple(case["case"]) in passed), case
        if case["outcome"] == "pass":
            passed.add(tuple(case["case"]))
    outcomes = {c["outcome"] for c in first["replayed"] + second["own"]}
    assert outcomes == {"pass", "error"}  # both verdicts exercised
