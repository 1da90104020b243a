"""Checks that run when XLA compiles (mesh axes of type `Auto`), and their failures.

At trace time `schedule` binds a `jts_check_sharding` primitive (see `primitive`)
holding a `CompileTimeCheck`: the annotation, the traced value's per-example shape,
the mesh, the site (function, argument, line) and the mode, all fixed when traced,
so that a cached trace or executable replays the mode it was made in (the mode is
also part of JAX's cache key: `_core.modes`).

Lowering registers each check with the `Compile` of its module, in trace order.
XLA calls each back with the sharding it chose (from its own threads, where an
exception would reach the user as `JaxRuntimeError: INTERNAL: ...`), and the check
only records a mismatch. When the compile has ended, JAX tells `jax.monitoring`
listeners in the thread that compiled, and there every mismatch of that compile
is raised as one `ShardingTypeCheckError`, in trace order, through plain `jax.jit`
as well as `jaxtyping_shard.jit`.
"""

import re
import threading
import time
import warnings
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingTypeCheckError, ShardingWarning
from .._core.failures import warn_at_user_line
from .._core.site import find_site
from .._layout import spec as _spec
from . import primitive as _primitive
from .compare import equivalent, FIX, shards_nothing


# JAX-private getters: whether our compile listeners are still registered (see
# `_listen_to_compiles`); without them, the listeners are registered once.
try:
    from jax._src.monitoring import (
        get_event_duration_listeners as _get_duration_listeners,
        get_scalar_listeners as _get_scalar_listeners,
    )
except ImportError:  # pragma: no cover - a JAX without them
    _get_duration_listeners = _get_scalar_listeners = None


def schedule(
    cls: Any, obj: Any, aval: Any, mesh: Any, mode: str, members: tuple = ()
) -> None:
    """Checks `obj`'s sharding once XLA has chosen it (`Auto` mesh axes).

    `members`: the other annotations of a Union that `obj` may match instead.
    """
    _listen_to_compiles()
    check = CompileTimeCheck(cls, aval, mesh, find_site(obj, cls), mode, members)
    _primitive.bind(obj, check)
    if watching.checks is not None:
        watching.checks.append((obj, check))


class _Watching(threading.local):
    # A list while `sharded_init` traces its function: `(value, check)` for every
    # check scheduled, so that the checks of values the function returns can be
    # moved onto the concrete result (`CompileTimeCheck.on_result`).
    checks: Optional[list] = None


watching = _Watching()


class CompileTimeCheck:
    """One annotation on one traced value; hashed and compared by identity."""

    def __init__(
        self, cls: Any, aval: Any, mesh: Any, site: Any, mode: str, members=()
    ):
        self.cls = cls
        self.members = tuple(members)
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype
        self.mesh = mesh
        self.site = site
        self.mode = mode
        # True: the value is a result of `sharded_init`, checked on the concrete
        # array instead; XLA may report another layout for an internal copy of it
        # (a constant copied per user), which would be a false alarm.
        self.on_result = False

    def __repr__(self) -> str:
        return f"<check {self.cls._jts.text} on {self.site.describe()}>"

    def mismatch(self, sharding: Any, batch_dims: tuple[int, ...]) -> Optional[str]:
        """`None` when `sharding` (of the value, batch dims included) matches."""
        ndim = len(self.shape)
        cls = self.cls
        anyof = (cls, *self.members)  # a Union: any member whose shape fits
        if 0 in self.shape:
            # No elements, nothing laid out: XLA calls every such value replicated,
            # and every annotation describes it (eager and trace time agree).
            return None
        if isinstance(sharding, _primitive.Maximal):
            if any(shards_nothing(m, self.mesh) for m in anyof):
                return None
            actual = (
                f"`{_spec.format_array(self.dtype, self.shape, ())}` on one device "
                f"({sharding.hlo})"
            )
        elif isinstance(sharding, _primitive.Untileable):
            actual = (
                f"`{_spec.format_array(self.dtype, self.shape, ())}` tiled as "
                f"{sharding.hlo}, which no PartitionSpec on this mesh can write"
            )
        else:
            sharding = _drop_dims(sharding, batch_dims)
            if type(sharding) is NamedSharding:
                if any(equivalent(m, sharding.mesh, sharding, ndim) for m in anyof):
                    return None
                entries = _spec.entries_of(sharding.spec)
                actual = f"`{_spec.format_array(self.dtype, self.shape, entries)}`"
            else:
                if sharding.is_fully_replicated and any(
                    shards_nothing(m, self.mesh) for m in anyof
                ):
                    return None
                plain = _spec.format_array(self.dtype, self.shape, ())
                actual = f"`{plain}` ({sharding})"
        expected = f"{cls._jts.text} as expected by the type hint {cls.__name__}"
        if self.members:
            expected = "any member of the Union in the type hint: " + ", ".join(
                m._jts.text for m in anyof
            )
        return (
            f"{self.site.describe()}: XLA sharded it as {actual}, not {expected} "
            f"(mesh {_mesh.format_mesh(self.mesh)})"
        )

    def lowered(
        self, module_cache: dict, module_name: str, batch_dims: tuple[int, ...]
    ) -> Any:
        """Registers this check with the `Compile` of the module being lowered
        (called by the primitive's lowering); returns what XLA's callback calls
        with the sharding it chose."""
        return compile_of(module_cache, module_name).register(self, batch_dims)

    def on_concrete(self, sharding: Any, batch_dims: tuple[int, ...]) -> None:
        """The check met a concrete array (a jaxpr evaluated eagerly)."""
        mismatch = self.mismatch(sharding, batch_dims)
        if mismatch is None or self.mode == "off":
            return
        message = f"{mismatch}. {FIX}"
        if self.mode == "warn":
            warnings.warn(message, ShardingWarning, stacklevel=2)
            return
        raise ShardingTypeCheckError(message)


def _drop_dims(sharding: Any, dims: tuple[int, ...]) -> Any:
    """The per-example sharding: `sharding` without its batch dims (from `vmap`)."""
    if not dims or type(sharding) is not NamedSharding:
        return sharding
    entries = list(sharding.spec)
    entries += [None] * (max(dims) + 1 - len(entries))
    kept = [e for i, e in enumerate(entries) if i not in dims]
    return NamedSharding(
        sharding.mesh, PartitionSpec(*kept), memory_kind=sharding.memory_kind
    )


_COMPILE_KEY = object()


def compile_of(module_cache: dict, module_name: str) -> "Compile":
    """The `Compile` of the module being lowered (kept in its per-module cache)."""
    compile_ = module_cache.get(_COMPILE_KEY)
    if compile_ is None:
        compile_ = module_cache[_COMPILE_KEY] = Compile(module_name)
    return compile_


class Compile:
    """The compile-time checks of one lowered module, gathered into one verdict.

    XLA calls the checks back from its own threads while it compiles; they only
    record what they find. When the compile ends, JAX announces it in the calling
    thread (`_on_compile_end`), and every mismatch of that compile is raised there,
    in trace order, as one error (or warned about, in mode "warn").
    """

    def __init__(self, module_name: str):
        self.module_name = module_name
        name = module_name[4:] if module_name.startswith("jit_") else module_name
        self.name = name
        self.checks: list[tuple[CompileTimeCheck, tuple[int, ...]]] = []
        # Kept across compiles: XLA compiles a module the same way each time.
        self.found: dict[int, str] = {}
        self.reported_at = 0.0
        self.thread = threading.get_ident()  # lowering and compiling share one

    def register(self, check: CompileTimeCheck, batch_dims: tuple[int, ...]) -> Any:
        index = len(self.checks)
        self.checks.append((check, batch_dims))
        return lambda sharding: self.report(index, sharding)

    def report(self, index: int, sharding: Any) -> None:
        check, batch_dims = self.checks[index]
        if check.on_result:
            return
        mismatch = check.mismatch(sharding, batch_dims)
        if mismatch is None:
            return
        with _pending_lock:
            self.found.setdefault(index, mismatch)
            self.reported_at = time.time()
            _pending[id(self)] = self
            if len(_pending) > 256:  # compiles that never ended: drop the oldest
                del _pending[next(iter(_pending))]

    def take(self) -> tuple[list[str], list[str]]:
        """The mismatches found (to raise, to warn about), in trace order."""
        with _pending_lock:
            found = dict(self.found)
        errors, warns = [], []
        for index in sorted(found):
            mode = self.checks[index][0].mode
            (warns if mode == "warn" else errors).append(found[index])
        return errors, warns


_pending: "dict[int, Compile]" = {}
_pending_lock = threading.Lock()
_compile_started = threading.local()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _module_name(fun_name: str) -> str:
    # As JAX names the module of `jit(f)`: `jit_f`.
    return re.sub(r"[^\w.-]", "_", fun_name).rstrip("_")


def _on_compile_start(event: str, value: Any, **kwargs: Any) -> None:
    if event == _COMPILE_EVENT:
        _compile_started.at = value


def _on_compile_end(event: str, duration_secs: float, **kwargs: Any) -> None:
    if event != _COMPILE_EVENT:
        return
    started = getattr(_compile_started, "at", None)
    module_name = _module_name(str(kwargs.get("fun_name", "")))
    thread = threading.get_ident()
    with _pending_lock:
        recent = [
            c for c in _pending.values() if started is None or c.reported_at >= started
        ]
    # Other threads may compile at the same time. A module is lowered in the thread
    # that compiles it (a `jit` call, `.lower(...).compile()`), unless JAX reuses a
    # lowering cached by another thread, or the user compiles a `Lowered` elsewhere:
    # then the module of this name, else any (better raised twice than never).
    mine = [c for c in recent if c.thread == thread]
    if not mine:
        mine = [c for c in recent if c.module_name == module_name] or recent
    errors: list[str] = []
    for c in mine:
        found, warns = c.take()
        errors += found
        for mismatch in dict.fromkeys(warns):
            warn_at_user_line(
                f"{mismatch}; checked when `{c.name}` was compiled. {FIX}"
            )
    if errors:
        raise ShardingTypeCheckError(_message(mine[0].name, errors))


def _listen_to_compiles() -> None:
    """Runs `_on_compile_*` around every XLA compile, in the compiling thread.

    JAX reports each backend compile to `jax.monitoring` listeners (public API):
    a scalar event when it starts and a duration event when it has ended, both in
    the thread that asked for the compile, and lets their exceptions through. The
    event's name is a constant of `jax._src.dispatch` (`BACKEND_COMPILE_EVENT`);
    `tests/test_compile_check.py` checks that it still fires.

    Called again each time a check is traced: `jax.monitoring.clear_event_listeners()`
    (public) would otherwise silence every compile-time failure. Whether the
    listeners are still there is read from JAX's private getters; without them,
    they are registered once.
    """
    if _get_duration_listeners is None or _get_scalar_listeners is None:
        if _listening:  # pragma: no cover - a JAX without the getters
            return
    else:
        if _on_compile_end in _get_duration_listeners() and (
            _on_compile_start in _get_scalar_listeners()
        ):
            return
        if _on_compile_start in _get_scalar_listeners():
            jax.monitoring.unregister_scalar_listener(_on_compile_start)
        if _on_compile_end in _get_duration_listeners():
            jax.monitoring.unregister_event_duration_listener(_on_compile_end)
    jax.monitoring.register_scalar_listener(_on_compile_start)
    jax.monitoring.register_event_duration_secs_listener(_on_compile_end)
    _listening.append(True)


_listening: list = []


_listen_to_compiles()


def _message(name: str, mismatches: list[str]) -> str:
    unique = list(dict.fromkeys(mismatches))  # jaxtyped re-checks arguments
    count = len(unique)
    noun = "mismatch" if count == 1 else "mismatches"
    head = f"{count} sharding {noun} while compiling `{name}`:"
    if count == 1:
        lines = [f"{head} {unique[0]}."]
    else:
        lines = [head, *(f"  {i}. {m}." for i, m in enumerate(unique, 1))]
    lines.append(FIX)
    return "\n".join(lines)
