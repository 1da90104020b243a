"""The check mode: `check` (raise), `warn` (warn instead) or `off`."""

import contextlib
import os
import threading
from typing import Literal


Mode = Literal["check", "warn", "off"]
MODES: tuple[str, ...] = ("check", "warn", "off")
ENV_VAR = "JAXTYPING_SHARD_MODE"


def _mode_from_env() -> str:
    value = os.environ.get(ENV_VAR, "check").strip().lower() or "check"
    if value not in MODES:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a mode of jaxtyping_shard; "
            f"use one of {', '.join(MODES)}."
        )
    return value


class _State:
    # A plain attribute: the hot path reads `state.mode` once per check.
    mode: str = _mode_from_env()


state = _State()
_lock = threading.Lock()


class _ModeSetter:
    """What `set_mode` returns: the change is already made; `with` undoes it."""

    def __init__(self, previous: str):
        self.previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        with _lock:
            state.mode = self.previous

    def __repr__(self) -> str:
        return f"<jaxtyping_shard mode {state.mode!r}, was {self.previous!r}>"


def set_mode(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Sets how sharding checks behave, for the whole process.

    !!! Example

        ```python
        import jaxtyping_shard as jts

        jts.set_mode("warn")          # from now on
        with jts.set_mode("off"):     # just for this block
            ...
        ```

    The environment variable `JAXTYPING_SHARD_MODE` sets the starting mode when
    `jaxtyping_shard` is imported.

    **Arguments:**

    - `mode`: `"check"` (the default: a mismatch is a type-check failure), `"warn"`
        (a mismatch emits a [`jaxtyping_shard.ShardingWarning`][] and the check
        passes) or `"off"` (sharding is not looked at; jaxtyping's shape and dtype
        checks still run).

    **Returns:**

    An object that, used as a context manager, restores the previous mode on exit.

    **Raises:**

    `ValueError` for an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(
            f"{mode!r} is not a mode of jaxtyping_shard; use one of "
            f"{', '.join(repr(m) for m in MODES)}."
        )
    with _lock:
        previous = state.mode
        state.mode = mode
    return _ModeSetter(previous)


def get_mode() -> Mode:
    """Returns the current mode: `"check"`, `"warn"` or `"off"`."""
    return state.mode  # type: ignore[return-value]
