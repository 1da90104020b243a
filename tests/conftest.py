import os


# The suite compiles hundreds of programs, and XLA's CPU backend optimises each
# one's machine code. No check lives there (they run while JAX traces and while
# XLA partitions the HLO, which this flag leaves alone), so the tests compile
# with it off: about a quarter of the suite's time (benchmarks/ never set it).
# Before JAX creates its CPU client, which reads XLA_FLAGS once; subprocesses of
# the tests inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_FLAGS = os.environ.get("XLA_FLAGS", "")
if _FAST_COMPILE not in _FLAGS:
    os.environ["XLA_FLAGS"] = f"{_FLAGS} {_FAST_COMPILE}".strip()

import pytest  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402

from .helpers import CHECKERS  # noqa: E402


@pytest.fixture(params=CHECKERS)
def checker(request):
    return request.param


@pytest.fixture(autouse=True)
def _default_mode():
    # Each test starts and ends with the default mode "check", whatever a failed
    # test left behind (a bare `set_mode` sets the process default).
    jts.set_mode("check")
    yield
    jts.set_mode("check")


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the differential tests with many more examples",
    )
    parser.addoption(
        "--reverse",
        action="store_true",
        default=os.environ.get("JAXTYPING_SHARD_TEST_ORDER") == "reverse",
        help="run the tests in reverse order (also JAXTYPING_SHARD_TEST_ORDER=reverse)",
    )


@pytest.fixture(scope="session")
def slow(request):
    return request.config.getoption("--slow")


def pytest_collection_modifyitems(config, items):
    # The property tests (those whose example count the `slow` fixture sets) take
    # most of the run: marked `slow`, so `pytest -m "not slow"` gives a quick look.
    for item in items:
        if "slow" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    # No test may need an earlier one (a warm cache, a compile, a global): run in
    # reverse, the files and the tests in each, every test comes before those it
    # followed. CI's suite at the newest releases runs so (`.ci/run`).
    if config.getoption("--reverse"):
        items.reverse()
