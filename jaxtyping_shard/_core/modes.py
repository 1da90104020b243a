"""What decides how a check behaves (the mode, and later the logical rules), kept
where JAX's caches can see it.

JAX caches traces, lowerings and executables. A check runs while a function is
traced (Explicit axes) or compiled (Auto axes), so a cached trace or executable
replays the checks of the mode it was made in. Every value that decides whether
or how a check runs therefore lives in a [`ContextState`][]: a
`jax.make_user_context` state, which JAX adds to the key of its trace, lowering
and compile caches (plain `jax.jit` included). Change the mode, and the next call
traces and compiles afresh.
"""

import collections
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import jax

from . import compat


Mode = Literal["check", "warn", "off"]
MODES: tuple[str, ...] = ("check", "warn", "off")
ENV_VAR = "JAXTYPING_SHARD_MODE"
_T = TypeVar("_T")


def _mode_from_env() -> str:
    value = os.environ.get(ENV_VAR, "check").strip().lower() or "check"
    if value not in MODES:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a mode of jaxtyping_shard; "
            f"use one of {', '.join(MODES)}."
        )
    return value


def _fast_reader(user_context: Any) -> Any:
    """The object whose `.value` reads `user_context` fastest.

    `jax.make_user_context` returns a Python wrapper whose `.value` property calls
    the C++ state it holds as `_obj` (JAX 0.7+); reading that directly saves about
    60 ns on the hot path of every eager check. Falls back to the public wrapper
    when a JAX version lays it out differently.
    """
    raw = getattr(user_context, "_obj", None)
    if raw is not None and raw.value is user_context.value:
        return raw
    return user_context


_NO_VALUE: Any = object()


class _Scope:
    __slots__ = ("value", "manager")

    def __init__(self, value: Any, manager: Any):
        self.value = value
        self.manager = manager


class ContextState(Generic[_T]):
    """One value that decides how checks behave, in the key of JAX's caches.

    It has a process-wide default (`set_default`, read by every thread that has no
    scope of its own) and scopes (`push` / `pop`) that override it in the current
    thread only. Scopes may be closed in any order (generators, interleaved
    coroutines): closing one removes exactly that scope, and the value is that of
    the innermost scope still open, or the default. Both the default and the
    scopes are `jax.make_user_context` values, so `jax.jit`'s trace, lowering and
    compile caches are keyed on them.

    To add another piece of check context (the logical rules table, say), create
    one more state next to `MODE`:

        RULES = ContextState("rules", ())    # the value must be hashable

    read it with `RULES.value` where the check runs, and give users a
    `set_default` / `push` / `pop` front end as `set_mode` does. Nothing else is
    needed: JAX keys its caches on every such state.

    Asyncio tasks that share a thread share its scopes while they are open, as
    they share JAX's own context managers (`jax.set_mesh`): JAX's cache key reads
    thread-local state, and a check must read the same value as the key.
    """

    def __init__(self, name: str, default: _T):
        self.name = name
        self._context = jax.make_user_context(default)
        self._reader = _fast_reader(self._context)
        self._local = threading.local()
        self._lock = threading.Lock()
        # The value of every thread's scopes still open, counted (all threads).
        self._open: collections.Counter = collections.Counter()
        # Every value some thread may see now (the default and every open scope's).
        self.possible: frozenset = frozenset((default,))
        self.on_change: Any = None  # called (under the lock) when `possible` changes

    @property
    def value(self) -> _T:
        """The value in force in this thread: its innermost scope, else the default."""
        return self._reader.value

    def _update_possible(self, also: Any = _NO_VALUE) -> None:
        # Under `self._lock`. Conservative: every open scope's value, in any
        # thread, is possible (so is `also`, a value about to become the default).
        default = compat.get_user_context_global(self._context)
        possible = frozenset((default, *(v for v, n in self._open.items() if n)))
        if also is not _NO_VALUE:
            possible |= {also}
        if possible != self.possible:
            self.possible = possible
            if self.on_change is not None:
                self.on_change(possible)

    def get_default(self) -> _T:
        return compat.get_user_context_global(self._context)

    def set_default(self, value: _T) -> _T:
        """Sets the process-wide default; returns the previous one."""
        with self._lock:
            previous = compat.get_user_context_global(self._context)
            self._set_global(value)
        return previous

    def restore_default(self, value: _T, *, if_still: _T) -> None:
        """Sets the default back to `value` unless another call changed it since."""
        with self._lock:
            if compat.get_user_context_global(self._context) == if_still:
                self._set_global(value)

    def _set_global(self, value: _T) -> None:
        # Under `self._lock`. The fast paths first hear of both values (the old
        # and the new may each be read while the default changes), then of the
        # new one alone: no thread ever takes a fast path JAX's state disagrees
        # with, as `push` opens a scope only after the fast paths heard of it.
        self._update_possible(also=value)
        compat.set_user_context_global(self._context, value)
        self._update_possible()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, value: _T) -> object:
        """Opens a scope in this thread; returns the token that closes it."""
        scope = _Scope(value, self._context(value))
        with self._lock:  # before the scope opens: this thread never sees it stale
            self._open[value] += 1
            self._update_possible()
        scope.manager.__enter__()
        self._stack().append(scope)
        return scope

    def pop(self, token: object) -> None:
        """Closes the scope `token`, wherever it is in this thread's stack."""
        stack = self._stack()
        index = next((i for i, s in enumerate(stack) if s is token), None)
        if index is None:
            raise RuntimeError(
                f"This jaxtyping_shard {self.name} scope is not open in this "
                "thread: a scope must be closed in the thread that opened it."
            )
        above = stack[index + 1 :]
        # JAX's scopes restore what they replaced, so unwind to the closed one and
        # reopen the scopes that were above it.
        for scope in reversed(stack[index:]):
            scope.manager.__exit__(None, None, None)
        del stack[index:]
        for scope in above:
            scope.manager = self._context(scope.value)
            scope.manager.__enter__()
            stack.append(scope)
        with self._lock:
            value = token.value  # type: ignore[attr-defined]
            self._open[value] -= 1
            if not self._open[value]:  # unique values (trace tokens) do not pile up
                del self._open[value]
            self._update_possible()


MODE: ContextState[str] = ContextState("mode", _mode_from_env())
# Read `mode_reader.value` on hot paths: it saves a function call on each check.
mode_reader = MODE._reader


class _ModeFlags:
    """What the eager hot path must know of the mode before anything else: which
    modes some thread may be in now. Kept by `MODE` whenever the default or an
    open scope changes (under its lock, and before a thread can see the change);
    each listener is called then, and once when it registers."""

    __slots__ = ("off_nowhere", "off_everywhere", "_listeners")

    def __init__(self) -> None:
        # True while no thread can be in mode "off" (neither the default nor any
        # open scope): a check mode's cached pass then reads no mode at all.
        self.off_nowhere = True
        # True while every thread is in mode "off" (the default, and no scope of
        # another mode open): the sharding is not looked at, no mode is read.
        self.off_everywhere = False
        self._listeners: list[Callable[[_ModeFlags], None]] = []

    def update(self, possible: frozenset) -> None:
        self.off_nowhere = "off" not in possible
        self.off_everywhere = possible == _ONLY_OFF
        for listener in self._listeners:
            listener(self)

    def listen(self, listener: Callable[["_ModeFlags"], None]) -> None:
        with MODE._lock:
            self._listeners.append(listener)
            listener(self)


_ONLY_OFF = frozenset(("off",))
mode_flags = _ModeFlags()
mode_flags.update(MODE.possible)
MODE.on_change = mode_flags.update


def current_mode() -> str:
    """The mode in force in this thread (hot path: one read of JAX's state)."""
    return mode_reader.value


class _ModeSetter:
    """What `set_mode` returns: the default is already changed; `with` scopes it."""

    def __init__(self, mode: str, previous: str):
        self.mode = mode
        self.previous = previous
        self.token: Any = None

    def __enter__(self) -> None:
        # Used as a context manager: the change becomes a scope of this thread, and
        # the process default goes back to what it was.
        self.token = MODE.push(self.mode)
        MODE.restore_default(self.previous, if_still=self.mode)

    def __exit__(self, *exc_info: Any) -> None:
        MODE.pop(self.token)

    def __repr__(self) -> str:
        return f"<jaxtyping_shard mode {current_mode()!r}, was {self.previous!r}>"


def set_mode(mode: Mode) -> _ModeSetter:
    """Sets how sharding checks behave.

    Called on its own, it sets the process-wide default: every thread without a
    scope of its own uses it from now on. Used as a context manager, it sets the
    mode for the current thread until the block ends (other threads keep theirs);
    scopes nest and may close in any order.

    Mode changes take effect at once, also for functions already compiled: the mode
    is part of the key of JAX's trace, lowering and compile caches (plain `jax.jit`
    included), so a function traced in one mode is traced again in another.

    !!! Example

        ```python
        import jaxtyping_shard as jts

        jts.set_mode("warn")          # from now on, in every thread
        with jts.set_mode("off"):     # just for this block, in this thread
            pass
        jts.set_mode("check")
        ```

    The environment variable `JAXTYPING_SHARD_MODE` sets the starting default when
    `jaxtyping_shard` is imported.

    **Arguments:**

    - `mode`: `"check"` (the default: a mismatch is a type-check failure), `"warn"`
        (a mismatch emits a [`jaxtyping_shard.ShardingWarning`][] and the check
        passes) or `"off"` (sharding is not looked at; jaxtyping's shape and dtype
        checks still run).

    **Returns:**

    An object that, used as a context manager, makes the change local to the
    current thread and the block (the process default is set back on entry).
    Between the call and the entry of the `with`, other threads see the new mode as
    the default; the change is undone as the block is entered.

    **Raises:**

    `ValueError` for an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(
            f"{mode!r} is not a mode of jaxtyping_shard; use one of "
            f"{', '.join(repr(m) for m in MODES)}."
        )
    return _ModeSetter(mode, MODE.set_default(mode))


def get_mode() -> Mode:
    """Returns the mode in force in this thread: `"check"`, `"warn"` or `"off"`."""
    return current_mode()  # type: ignore[return-value]
