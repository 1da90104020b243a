import pytest

import jaxtyping_shard as jts

from .helpers import CHECKERS


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


@pytest.fixture(scope="session")
def slow(request):
    return request.config.getoption("--slow")


def pytest_collection_modifyitems(items):
    # The property tests (those whose example count the `slow` fixture sets) take
    # most of the run: marked `slow`, so `pytest -m "not slow"` gives a quick look.
    for item in items:
        if "slow" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
