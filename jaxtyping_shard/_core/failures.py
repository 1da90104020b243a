"""What becomes of a failed check's reason: returned, recorded, warned, or
collected (by `jts.preflight`, which lists every failure of a trace at once).

Only failures come here, so this may walk the stack.
"""

import contextlib
import itertools
import os
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

from .errors import ShardingWarning
from .modes import ContextState, MODE
from .site import find_site, Site, user_frame


def report(message: str, cls: Any, obj: Any, mode: str) -> str:
    """The reason to hand back to the type checker ("" in mode `"warn"`)."""
    if not message:
        return ""
    if mode == "warn":
        warn(message, cls, obj)
        return ""
    records = _records.stack
    if records:
        # Read by `jaxtyping_shard.jaxtyped` if this failure fails its call.
        records[-1].append((find_site(obj, cls), message))
    return message


class _Records(threading.local):
    # One list per `jaxtyping_shard.jaxtyped` call in progress on this thread.
    def __init__(self) -> None:
        self.stack: list[list[tuple[Site, str]]] = []


_records = _Records()


def push_records() -> list[tuple[Site, str]]:
    records: list[tuple[Site, str]] = []
    _records.stack.append(records)
    return records


def pop_records() -> None:
    _records.stack.pop()


_warned: "OrderedDict[tuple[Any, ...], Any]" = OrderedDict()
_warned_lock = threading.Lock()


def _first_warning(obj: Any, cls: Any, site: Site) -> bool:
    """Whether `obj` has not yet been warned about against `cls` in `site`'s function.

    `jaxtyped` checks each parameter twice (before the call, and again with the
    return value, when a parameter returned as is looks like the return value);
    one value failing one annotation in one function warns once. Arrays are held by
    weak reference, so remembering them keeps no device memory alive.
    """
    key = (id(obj), id(cls), site.function)
    with _warned_lock:
        held = _warned.get(key)
        if held is not None:
            target = held() if isinstance(held, weakref.ref) else held
            if target is obj:
                _warned.move_to_end(key)
                return False
        try:
            held = weakref.ref(obj)
        except TypeError:  # tracers: cheap to hold, and short-lived
            held = obj
        _warned[key] = held
        if len(_warned) > 256:
            _warned.popitem(last=False)
    return True


def warn(message: str, cls: Any, obj: Any) -> None:
    """Emits a `ShardingWarning` at the user's line, naming function and argument.

    Python's default filter shows a warning once per (text, line); two different
    values failing in the same way at the same line would show once. Each failing
    value warns once, so the warning goes out with a fresh registry; filters the
    user set (`"once"`, `"ignore"`, `"error"`) still apply.
    """
    site = find_site(obj, cls)
    if not _first_warning(obj, cls, site):
        return
    if site.function is not None or site.argument is not None:
        message = f"{site.describe(location=False)}: {message}"
    warn_at_user_line(message)


def warn_at_user_line(message: str) -> None:
    """A `ShardingWarning` at the first frame outside the library, with a fresh
    registry, so that each call warns (the user's filters still apply); collected
    instead while `collecting`."""
    frame = user_frame(sys._getframe(1))
    if collect(message, frame):
        return
    if frame is None:
        warnings.warn(message, ShardingWarning, stacklevel=3)
        return
    warnings.warn_explicit(
        message,
        ShardingWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry={},
        module_globals=frame.f_globals,
    )


class Finding(NamedTuple):
    """One failure collected while `collecting`: what, and the user's line."""

    message: str
    location: Optional[str]  # "train.py:40", or None when no user frame is found


class _Found(list):
    """The findings of one `collecting` block, in order, each once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[Finding] = set()


class _Collecting(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Found] = []


_collecting = _Collecting()
# In the key of JAX's caches, a value no earlier trace was made with: a trace
# cached by an earlier call would skip the checks (and their findings) of this one.
_TRACE_TOKEN: ContextState[int] = ContextState("collect", 0)
_tokens = itertools.count(1)


@contextlib.contextmanager
def collecting() -> Iterator[list[Finding]]:
    """Every failure in this block, in this thread, is collected into the list
    yielded, and the check passes (mode `"warn"`, whatever the mode was), so that
    one trace finds them all. JAX's caches miss every trace begun in the block."""
    found = _Found()
    _collecting.stack.append(found)
    mode, token = MODE.push("warn"), _TRACE_TOKEN.push(next(_tokens))
    try:
        yield found
    finally:
        _TRACE_TOKEN.pop(token)
        MODE.pop(mode)
        stack = _collecting.stack
        del stack[next(i for i, f in enumerate(stack) if f is found)]


def collect(message: str, frame: Any = None) -> bool:
    """Adds a failure to the list of the innermost `collecting` block, if any,
    located at `frame` (default: the first user frame of the caller)."""
    if not _collecting.stack:
        return False
    if frame is None:
        frame = user_frame(sys._getframe(1))
    location = None
    if frame is not None:
        location = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    found = _collecting.stack[-1]
    finding = Finding(message, location)
    if finding not in found.seen:  # jaxtyped checks each parameter twice
        found.seen.add(finding)
        found.append(finding)
    return True
