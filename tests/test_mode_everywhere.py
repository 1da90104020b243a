"""The eager hot path is chosen by the modes some thread may be in (`MODE.possible`):
it reads no mode while every thread sees the same one, and JAX's thread-local state
otherwise. The two must never disagree, whatever the order of scopes, defaults and
threads."""

import threading

import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core.modes import MODE, mode_reader

from .helpers import place


VARIES = "threads may see different modes"


def _everywhere() -> object:
    # The mode every thread sees, by `MODE.possible` (what the hot path's state
    # is derived from), or VARIES.
    possible = MODE.possible
    return next(iter(possible)) if len(possible) == 1 else VARIES


def _agrees() -> None:
    # Wherever the list says a value, it is the one JAX's state gives this thread.
    value = _everywhere()
    if value is not VARIES:
        assert value == mode_reader.value


def test_default_and_scopes_of_the_same_mode_are_uniform():
    assert _everywhere() == "check"
    with jts.set_mode("check"):
        assert _everywhere() == "check"
        _agrees()
    assert _everywhere() == "check"


def test_a_scope_of_another_mode_varies_until_closed():
    with jts.set_mode("off"):
        assert _everywhere() is VARIES
        assert mode_reader.value == "off"
        with jts.set_mode("check"):
            assert _everywhere() is VARIES  # the "off" scope is still open
        assert _everywhere() is VARIES
    assert _everywhere() == "check"


def test_default_changes_are_seen():
    previous = MODE.get_default()
    try:
        jts.set_mode("off")
        assert _everywhere() == "off"
        _agrees()
        with jts.set_mode("off"):  # same as the default: still uniform
            assert _everywhere() == "off"
        with jts.set_mode("warn"):
            assert _everywhere() is VARIES
        assert _everywhere() == "off"
    finally:
        jts.set_mode(previous)
    assert _everywhere() == previous


def test_scopes_closed_out_of_order():
    outer = MODE.push("off")
    inner = MODE.push("warn")
    try:
        MODE.pop(outer)
        assert mode_reader.value == "warn"
        assert _everywhere() is VARIES
    finally:
        MODE.pop(inner)
    assert _everywhere() == "check"
    _agrees()


def test_an_unopened_token_changes_nothing():
    token = MODE.push("off")
    MODE.pop(token)
    with pytest.raises(RuntimeError, match="not open"):
        MODE.pop(token)
    assert _everywhere() == "check"


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
def test_off_in_one_thread_checks_in_another(mesh_kind, mesh_explicit, mesh_auto):
    # A thread in mode "off" must not switch off the eager checks of another
    # thread, before, during and after its scope (warm caches included).
    mesh = mesh_explicit if mesh_kind == "explicit" else mesh_auto
    A = Float[Array, "b e", P("data", None)]
    good = place(mesh, (8, 4), P("data", None))
    bad = place(mesh, (8, 4), P("model", None))
    assert isinstance(good, A) and not isinstance(bad, A)  # warm: `_jts_last` set
    opened, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def other() -> None:
        with jts.set_mode("off"):
            seen["other sees bad"] = isinstance(bad, A)
            opened.set()
            release.wait(10)
            seen["other sees bad, later"] = isinstance(bad, A)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert opened.wait(10)
        assert _everywhere() is VARIES
        assert mode_reader.value == "check"
        assert not isinstance(bad, A)
        assert isinstance(good, A)
    finally:
        release.set()
        thread.join(10)
    assert seen == {"other sees bad": True, "other sees bad, later": True}
    assert _everywhere() == "check"
    assert not isinstance(bad, A)


def test_off_nowhere_flag_follows_every_way_to_mode_off():
    from jaxtyping_shard._core.modes import mode_flags

    assert mode_flags.off_nowhere
    with jts.set_mode("warn"):  # not off: cached passes still need no mode read
        assert mode_flags.off_nowhere
    with jts.set_mode("off"):
        assert not mode_flags.off_nowhere
        with jts.set_mode("check"):
            assert not mode_flags.off_nowhere  # the outer "off" scope is open
    assert mode_flags.off_nowhere
    previous = MODE.get_default()
    try:
        jts.set_mode("off")
        assert not mode_flags.off_nowhere
    finally:
        jts.set_mode(previous)
    assert mode_flags.off_nowhere


@pytest.mark.parametrize("how", ["scope", "default"])
def test_off_skips_a_mismatch_with_a_warm_annotation(how, mesh_explicit):
    # Warm `_jts_last` with a good array, then in mode off a mis-sharded one
    # passes (sharding not looked at) and after it is refused again.
    A = Float[Array, "b e", P("data", None)]
    good = place(mesh_explicit, (8, 4), P("data", None))
    bad = place(mesh_explicit, (8, 4), P("model", None))
    assert isinstance(good, A) and not isinstance(bad, A)
    if how == "scope":
        with jts.set_mode("off"):
            assert isinstance(bad, A) and isinstance(good, A)
            assert not isinstance(place(mesh_explicit, (8,), P("data")), A)
    else:
        previous = MODE.get_default()
        try:
            jts.set_mode("off")
            assert _everywhere() == "off"
            assert isinstance(bad, A) and isinstance(good, A)
            assert not isinstance(place(mesh_explicit, (8,), P("data")), A)
        finally:
            jts.set_mode(previous)
    assert not isinstance(bad, A) and isinstance(good, A)


def test_closed_scopes_leave_nothing_behind():
    # A ContextState whose every scope has a new value (the trace token of
    # `collecting`) must not keep one entry per scope ever opened.
    from jaxtyping_shard._core.failures import _TRACE_TOKEN

    for _ in range(50):
        _TRACE_TOKEN.pop(_TRACE_TOKEN.push(object()))
    assert not _TRACE_TOKEN._open
    assert _TRACE_TOKEN.possible == frozenset((_TRACE_TOKEN.get_default(),))


def _installed() -> object:
    from jaxtyping_shard._annotation.dtypes import _MetaShardedArray

    return _MetaShardedArray.__dict__["__instancecheck__"]


def test_the_hot_path_in_force_follows_every_way_to_a_mode():
    from jaxtyping_shard._annotation import hot_path

    nowhere, everywhere = hot_path.while_off_nowhere, hot_path.while_off_everywhere
    vary = hot_path.while_modes_vary
    assert _installed() is nowhere
    with jts.set_mode("warn"):
        assert _installed() is nowhere
    with jts.set_mode("off"):
        assert _installed() is vary  # other threads are in mode check
    previous = MODE.get_default()
    try:
        jts.set_mode("off")
        assert _installed() is everywhere
        with jts.set_mode("off"):
            assert _installed() is everywhere
        with jts.set_mode("check"):
            assert _installed() is vary
        token = MODE.push("warn")
        assert _installed() is vary
        MODE.pop(token)
        assert _installed() is everywhere
    finally:
        jts.set_mode(previous)
    assert _installed() is nowhere


@pytest.mark.parametrize("to", ["check", "warn"])
def test_a_new_default_reaches_the_hot_path_before_jax(to, monkeypatch):
    # Between the change of JAX's default and the swap of the hot path another
    # thread may check: the hot path must already allow both modes then.
    from jaxtyping_shard._annotation import hot_path
    from jaxtyping_shard._core import compat

    seen: list = []
    real = compat.set_user_context_global

    def recording(context, value):
        seen.append((compat.get_user_context_global(context), value, _installed()))
        real(context, value)

    previous = MODE.get_default()
    monkeypatch.setattr(compat, "set_user_context_global", recording)
    try:
        jts.set_mode("off")
        jts.set_mode(to)  # type: ignore[arg-type]
        with jts.set_mode("off"):  # the default, changed and restored on entry
            pass
    finally:
        jts.set_mode(previous)
    changes = [(old, new, installed) for old, new, installed in seen if old != new]
    # off, then `to`, then off and back to `to` on the scope's entry, then back.
    assert [new for _, new, _ in changes] == ["off", to, "off", to, previous][
        : len(changes)
    ]
    assert len(changes) == (4 if to == previous else 5)
    for old, new, installed in changes:
        both = {old, new}
        if "off" in both:  # a thread may read either mode: each check reads it
            assert installed is hot_path.while_modes_vary
        else:
            assert installed is hot_path.while_off_nowhere


def test_off_everywhere_still_checks_shape_dtype_and_every_other_value(mesh_explicit):
    import jax
    import numpy as np

    A = Float[Array, "b e", P("data", None)]
    bad = place(mesh_explicit, (8, 4), P("model", None))

    @jax.jit
    def traced(x):
        return isinstance(x, A)

    previous = MODE.get_default()
    try:
        jts.set_mode("off")
        assert _everywhere() == "off"
        assert isinstance(bad, A)  # a jax.Array: jaxtyping's check only
        assert not isinstance(place(mesh_explicit, (8,), P("data")), A)
        assert not isinstance(bad.astype("int32"), A)
        assert not isinstance(np.ones((8, 4), np.float32), A)  # not a jax.Array
        assert bool(traced(bad))  # a tracer of a mis-sharded argument
    finally:
        jts.set_mode(previous)
    # Back in mode check, warm caches included (the trace is keyed on the mode).
    assert not isinstance(bad, A)
    assert not bool(traced(bad))


def _mode_changes_under_checks(mesh, changes: int) -> list[str]:
    """One thread changes the default (off <-> check) `changes` times while two
    others check a mis-sharded and a good array, one of them inside a scope of
    mode off every other check; a check must agree with the mode its thread read
    before and after it, whenever no change of the default ended between."""
    import sys

    A = Float[Array, "b e", P("data", None)]
    good = place(mesh, (8, 4), P("data", None))
    bad = place(mesh, (8, 4), P("model", None))
    assert isinstance(good, A) and not isinstance(bad, A)
    ended = [0]  # changes ended so far
    stop = threading.Event()
    wrong: list[str] = []
    previous_default = MODE.get_default()

    def changer() -> None:
        try:
            for i in range(changes):
                jts.set_mode("off" if i % 2 == 0 else "check")
                ended[0] += 1
        finally:
            stop.set()

    def checker(scoped: bool) -> None:
        i = 0
        while not stop.is_set() and len(wrong) < 5:
            i += 1
            # A scope of this thread alone (`MODE.push`: `with set_mode` would
            # also change the default for a moment, as documented).
            token = MODE.push("off") if scoped and i % 2 else None
            seen, before = ended[0], mode_reader.value
            got = isinstance(bad, A)
            after = mode_reader.value
            if token is not None:
                MODE.pop(token)
            if ended[0] == seen and before == after and got != (before == "off"):
                wrong.append(f"mode {before!r}: a mis-sharded array gave {got}")
            if not isinstance(good, A):
                wrong.append(f"mode {before!r}: a good array refused")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: checks land mid-change
    threads = [threading.Thread(target=checker, args=(s,)) for s in (False, True)]
    threads.append(threading.Thread(target=changer))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
        jts.set_mode(previous_default)
    return wrong


def test_checks_agree_with_their_mode_while_the_default_changes(mesh_explicit):
    # Without the early announcement of a new default (`_set_global`), a check
    # landing between JAX's change and the hot path's swap skipped the sharding
    # in mode check: this test caught it in 6 runs of 6.
    from jaxtyping_shard._annotation import hot_path
    from jaxtyping_shard._core.modes import mode_flags

    assert _mode_changes_under_checks(mesh_explicit, 2000) == []
    assert _installed() is hot_path.for_flags(mode_flags) is hot_path.while_off_nowhere
