"""Speculation comes back (issue 22, item 6).

After STALE_LIMIT speculative misses in a row `jts.jit` backs off: no
speculation for a pause of ordinary calls, then one try; a try that misses
doubles the pause (up to BACKOFF_LIMIT), a hit resets it. A train/eval
interleave stays cheap (about one miss per pause), and a steady train loop
after it is speculative again. A fresh `with jts.axis_rules(same_table):` each
step is the same table: it does not defeat speculation. Explicit, Auto and mixed
meshes; every answer checked against the numbers and, after the resumption, a
mis-placed argument is still refused.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts
from jaxtyping_shard._drivers.jit import entry as _jit_entry

from .helpers import MESHES, place
from .speculation import annotated_jit, apply, args_on, LOGICAL, Ordinary, want


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


class Misses:
    """Counts the speculative calls JAX's C++ cache could not answer."""

    def __init__(self, monkeypatch):
        self.count = 0
        call = _jit_entry.Speculation.call

        def counted(speculation, args):
            try:
                return call(speculation, args)
            except Exception:
                self.count += 1
                raise

        monkeypatch.setattr(_jit_entry.Speculation, "call", counted)


def test_a_steady_loop_after_an_interleave_is_speculative_again(mesh, monkeypatch):
    f = annotated_jit(apply)
    m, train = args_on(mesh)
    _, evaluation = args_on(mesh, batch=16)
    ordinary = Ordinary(f, monkeypatch)
    misses = Misses(monkeypatch)
    interleaved = 200
    with jax.set_mesh(mesh):
        for i in range(interleaved):
            x = train if i % 2 == 0 else evaluation
            out = f(m, x)
            if i % 50 < 2:
                np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)
        # Alternating stays cheap: STALE_LIMIT misses, then one per pause (16,
        # 32, 64, ... calls), never one per call.
        assert misses.count <= _jit_entry.STALE_LIMIT + 4, misses.count
        assert ordinary.count == interleaved
        before = ordinary.count
        steady = _jit_entry.BACKOFF_LIMIT + 20
        for _ in range(steady):
            out = f(m, train)
        np.testing.assert_allclose(np.asarray(out), want(m, train), rtol=1e-6)
        resumed = ordinary.count - before
        # Speculative again: the ordinary way only for what was left of the
        # pause, then every call straight to JAX's dispatch.
        assert resumed <= _jit_entry.BACKOFF_LIMIT, resumed
        assert f._stale == 0 and f._window == _jit_entry.BACKOFF
        last = ordinary.count
        for _ in range(5):
            f(m, train)
        assert ordinary.count == last
        # Still checked after the resumption: a mis-placed argument is named.
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (8, 4), P()))
        assert f(m, train).sharding.is_equivalent_to(
            NamedSharding(mesh, P("data", "model")), 2
        )


def test_backing_off_grows_and_resets():
    # The pause doubles with each try that misses, up to BACKOFF_LIMIT, and a
    # hit resets it: the whole policy, on the function's counters.
    mesh = MESHES["explicit"]()
    f = annotated_jit(apply)
    m, train = args_on(mesh)
    _, evaluation = args_on(mesh, batch=16)
    pauses = []
    with jax.set_mesh(mesh):
        for i in range(2000):
            f(m, train if i % 2 == 0 else evaluation)
            if f._pause and (not pauses or f._pause > pauses[-1]):
                pauses.append(f._pause)
        assert pauses[0] == _jit_entry.BACKOFF - 1  # counted down at once
        assert f._window == _jit_entry.BACKOFF_LIMIT
        assert max(pauses) < _jit_entry.BACKOFF_LIMIT + 1
        for _ in range(_jit_entry.BACKOFF_LIMIT + 2):
            f(m, train)
    assert f._stale == 0 and f._window == _jit_entry.BACKOFF


def test_a_fresh_rules_table_each_step_keeps_speculating(mesh, monkeypatch):
    def double(x: LOGICAL) -> LOGICAL:
        return x * 2

    f = annotated_jit(double)
    rows = place(mesh, (8, 4), P("data", None))
    cols = place(mesh, (8, 4), P(None, "data"))
    ordinary = Ordinary(f, monkeypatch)
    misses = Misses(monkeypatch)
    with jax.set_mesh(mesh):
        for _ in range(3 * _jit_entry.STALE_LIMIT):
            with jts.axis_rules({"batch": "data", "embed": None}):  # a new table
                out = f(rows)
        assert ordinary.count == 1 and misses.count == 0
        np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(rows))
        # Another table (equal to none before) still derives again, and its
        # layout is the one checked.
        with jts.axis_rules({"batch": None, "embed": "data"}):
            with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
                f(rows)
            assert f(cols).sharding.spec == P(None, "data")
        with jts.axis_rules({"batch": "data", "embed": None}):
            assert f(rows).sharding.spec == P("data", None)
            count = ordinary.count
            f(rows)
        assert ordinary.count == count  # speculative on the fresh equal table
