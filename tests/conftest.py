import pytest

import jaxtyping_shard as jts

from .helpers import CHECKERS


@pytest.fixture(params=CHECKERS)
def checker(request):
    return request.param


@pytest.fixture(autouse=True)
def _default_mode():
    # Each test starts in mode "check", whatever a failed test left behind.
    with jts.set_mode("check"):
        yield
