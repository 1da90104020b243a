"""What becomes of a failed check's reason: returned, recorded, or warned.

Only failures come here, so this may walk the stack.
"""

import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any

from .errors import ShardingWarning
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
    registry, so that each call warns (the user's filters still apply)."""
    frame = user_frame(sys._getframe(1))
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
