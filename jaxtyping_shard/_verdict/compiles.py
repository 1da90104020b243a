"""One compile's checks gathered into one verdict, raised when JAX says the
compile has ended, and kept out of JAX's persistent compilation cache if any failed.

XLA calls each check back with the sharding it chose (from its own threads, where
an exception would reach the user as `JaxRuntimeError: INTERNAL: ...`), and the
check only records a mismatch in the `Compile` of its module. When the compile has
ended, JAX tells `jax.monitoring` listeners in the thread that compiled, and there
every mismatch of that compile is raised as one `ShardingTypeCheckError`, in trace
order, through plain `jax.jit` as well as `jaxtyping_shard.jit`.
"""

import inspect
import re
import threading
import time
from typing import Any, Optional

import jax
from jax.interpreters import mlir

from .._core.errors import ShardingTypeCheckError
from .._core.failures import warn_at_user_line
from . import custom_call as _custom_call, primitive as _primitive
from .compare import FIX


# JAX-private getters: whether our listeners are still registered (see
# `listen`); without them, the listeners are registered once.
try:
    from jax._src.monitoring import (
        get_event_duration_listeners,
        get_event_listeners,
        get_scalar_listeners,
    )

    _getters: Optional[dict] = {
        "scalar": get_scalar_listeners,
        "event_duration": get_event_duration_listeners,
        "event": get_event_listeners,
    }
except ImportError:  # pragma: no cover - a JAX without them
    _getters = None


_COMPILE_KEY = object()


def compile_of(module_cache: dict, module_name: str) -> "Compile":
    """The `Compile` of the module being lowered (kept in its per-module cache)."""
    compile_ = module_cache.get(_COMPILE_KEY)
    if compile_ is None:
        compile_ = module_cache[_COMPILE_KEY] = Compile(module_name)
    _compile_started.lowered = compile_  # this thread's, for its next compile
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
        self.checks: list[tuple[Any, tuple[int, ...]]] = []
        # Kept across compiles: XLA compiles a module the same way each time.
        self.found: dict[int, str] = {}
        self.reported_at = 0.0
        self.thread = threading.get_ident()  # lowering and compiling share one
        self.mesh_shape: Optional[tuple] = None  # of the shardings XLA reported

    def register(self, check: Any, batch_dims: tuple[int, ...]) -> int:
        self.checks.append((check, batch_dims))
        return len(self.checks) - 1

    def fingerprint(self, index: int) -> str:
        check, batch_dims = self.checks[index]
        return check.fingerprint(batch_dims)

    def report(self, index: int, sharding: Any) -> None:
        check, batch_dims = self.checks[index]
        if check.on_result:
            return
        mismatch = check.mismatch(sharding, batch_dims)
        if mismatch is None:
            return
        shape = getattr(getattr(sharding, "mesh", None), "shape_tuple", None)
        with _pending_lock:
            self.found.setdefault(index, mismatch)
            self.reported_at = time.time()
            self.mesh_shape = shape
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
_CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"


def _module_name(fun_name: str) -> str:
    # As JAX names the module of `jit(f)`: `jit_f`.
    return re.sub(r"[^\w.-]", "_", fun_name).rstrip("_")


def _on_scalar(event: str, value: Any, **kwargs: Any) -> None:
    if event == _COMPILE_EVENT:
        _compile_started.at = value
        _compile_started.name = _module_name(str(kwargs.get("fun_name", "")))
        _compile_started.unwritten = None
        # The module this thread lowered with checks, if it is the one compiled.
        lowered = getattr(_compile_started, "lowered", None)
        _compile_started.lowered = None
        same = lowered is not None and lowered.module_name == _compile_started.name
        _compile_started.own = lowered if same else None
    elif event == _custom_call.LOWERING_EVENT:
        _custom_call.on_lowering_start()


def _on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
    if event == _COMPILE_EVENT:
        _on_compile_end()
    elif event == _custom_call.LOWERING_EVENT:
        _custom_call.on_lowering_end()


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_WRITE_EVENT and _pending:
        _refuse_cache_write()


def _this_compile() -> tuple[list["Compile"], list[str], list[str]]:
    """The `Compile`s of the compile under way in this thread, and what they found
    (to raise, to warn about), from reports since it started."""
    started = getattr(_compile_started, "at", None)
    module_name = getattr(_compile_started, "name", "")
    thread = threading.get_ident()
    with _pending_lock:
        recent = [
            c for c in _pending.values() if started is None or c.reported_at >= started
        ]
    # Other threads may compile at the same time. A module is lowered in the thread
    # that compiles it (a `jit` call, `.lower(...).compile()`), unless JAX reuses a
    # lowering cached by another thread (a failed compile is not cached, its
    # lowering is), or the user compiles a `Lowered` elsewhere: then the module of
    # this name, else any (better raised twice than never). A compile whose
    # shardings are on another mesh than this thread's context mesh is not this
    # thread's (several threads, each under its own `jax.set_mesh`, one function).
    context = jax.sharding.get_abstract_mesh()
    here = None if context.empty else context.shape_tuple

    def fits(c: "Compile") -> bool:
        return here is None or c.mesh_shape is None or c.mesh_shape == here

    own = getattr(_compile_started, "own", None) if started is not None else None
    if own is not None:
        # This thread lowered the module it compiles: its verdict is that
        # module's alone, clean or not, never another thread's mismatches.
        mine = [own] if own.found else []
    else:
        mine = [c for c in recent if c.thread == thread and fits(c)]
    if not mine and own is None:
        mine = (
            [c for c in recent if c.module_name == module_name and fits(c)]
            or [c for c in recent if fits(c)]
            # On no compile of this mesh: only what this thread lowered (its
            # arrays on another mesh than the context's), never another
            # thread's compile on another mesh (a clean compile, or one with
            # no compile-time checks, records nothing of its own).
            or [c for c in recent if c.thread == thread]
        )
    errors: list[str] = []
    warns: list[str] = []
    for c in mine:
        found, warned = c.take()
        errors += found
        warns += [f"{m}; checked when `{c.name}` was compiled. {FIX}" for m in warned]
    return mine, errors, warns


def _on_compile_end() -> None:
    unwritten = getattr(_compile_started, "unwritten", None)
    _compile_started.unwritten = None
    mine, errors, warns = _this_compile()
    _compile_started.own = None
    for message in dict.fromkeys(warns):
        warn_at_user_line(message)
    if unwritten is not None:
        # Stopped before JAX wrote the executable to its persistent cache (see
        # `_refuse_cache_write`): the error in place of that stop.
        raise unwritten from None
    if errors:
        raise ShardingTypeCheckError(_message(mine[0].name, errors))


class _Unwritten(BaseException):
    """Stops JAX writing a failed compile to its persistent compilation cache; the
    end of the compile replaces it with the `ShardingTypeCheckError`."""


class ShardingMismatchNotCached(Exception):
    """What JAX's warning names when a compile with mismatches (mode "warn") is
    kept out of its persistent compilation cache."""


ShardingMismatchNotCached.__module__ = "jaxtyping_shard"


def _refuse_cache_write() -> None:
    """Keeps a compile whose checks failed out of JAX's persistent compilation cache.

    A program found there is not compiled again, so XLA never calls its checks
    back: only programs whose checks all passed may be written, or a later process
    would run a mis-sharded program without a word. JAX announces the write
    (`/jax/compilation_cache/cache_misses`, a `jax.monitoring` event) in the
    compiling thread just before it writes. In mode "check" the compile fails: a
    `BaseException` gets past JAX's `except Exception` around the write, and the
    end of the compile raises the `ShardingTypeCheckError` in its place. In mode
    "warn" the compile must succeed: an `Exception` makes JAX skip the write, with
    its own warning ("Error writing persistent compilation cache entry") naming
    `ShardingMismatchNotCached`, beside ours.
    """
    mine, errors, warns = _this_compile()
    if errors:
        error = ShardingTypeCheckError(_message(mine[0].name, errors))
        _compile_started.unwritten = error
        raise _Unwritten(str(error))
    if warns:
        raise ShardingMismatchNotCached(
            f"jaxtyping_shard: `{mine[0].name}` has sharding mismatches (mode "
            '"warn"), so it is not written to the persistent compilation cache: a '
            "later process compiles it again and warns again"
        )


_LISTENERS = (
    ("scalar", _on_scalar),
    ("event_duration", _on_duration),
    ("event", _on_event),
)


def listen() -> None:
    """Runs `_on_*` around every lowering and XLA compile, in the thread that asks.

    JAX reports each lowering to MLIR and each backend compile to `jax.monitoring`
    listeners (public API): a scalar event when it starts and a duration event when
    it has ended, in the thread that asked, and lets their exceptions through; and
    just before it writes a compile to its persistent cache, an event. The names
    are constants of `jax._src.dispatch` (`JAXPR_TO_MLIR_MODULE_EVENT`,
    `BACKEND_COMPILE_EVENT`) and `jax._src.compilation_cache`;
    `tests/test_compile_check.py` and `tests/test_persistent_cache.py` check that
    they still fire.

    Called again each time a check is traced: `jax.monitoring.clear_event_listeners()`
    (public) would otherwise silence every compile-time failure. Whether the
    listeners are still there is read from JAX's private getters; without them,
    they are registered once.
    """
    if _getters is None:
        if _listening:  # pragma: no cover - a JAX without the getters
            return
    else:
        if all(fn in _getters[kind]() for kind, fn in _LISTENERS):
            return
        for kind, fn in _LISTENERS:
            if fn in _getters[kind]():
                getattr(jax.monitoring, f"unregister_{_UNREGISTER[kind]}")(fn)
    for kind, fn in _LISTENERS:
        getattr(jax.monitoring, f"register_{_REGISTER[kind]}")(fn)
    _listening.append(True)


_REGISTER = {
    "scalar": "scalar_listener",
    "event_duration": "event_duration_secs_listener",
    "event": "event_listener",
}
_UNREGISTER = {
    "scalar": "scalar_listener",
    "event_duration": "event_duration_listener",
    "event": "event_listener",
}
_listening: list = []


listen()


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


class ExportNotSupported(NotImplementedError):
    pass


ExportNotSupported.__module__ = "jaxtyping_shard"

_EXPORT_MESSAGE = (
    "jaxtyping_shard: `{name}` has sharding checks that run when XLA compiles it "
    "(mesh axes of type Auto), and `jax.export` cannot carry them: they call back "
    "into this Python process. Check the function first (call it through "
    "`jaxtyping_shard.jit`, or `jax.jit(f).lower(...).compile()`), then export it "
    "with the checks left out: `with jaxtyping_shard.set_mode('off'): "
    "jax.export.export(jax.jit(f))(...)`."
)


def _lower(ctx: Any, value: Any, *, check: Any, batch_dims: tuple[int, ...]) -> list:
    module = ctx.module_context
    if getattr(module.lowering_parameters, "for_export", False):
        name = _lowered_name(module)
        function = name[4:] if name.startswith("jit_") else name
        raise ExportNotSupported(_EXPORT_MESSAGE.format(name=function))
    # The module's name is read once per module: reading it from the MLIR module
    # cost 60 µs a check (a third of our lowering time, figure 5).
    compile_ = module.cached_primitive_lowerings.get(_COMPILE_KEY)
    if compile_ is None:
        compile_ = compile_of(module.cached_primitive_lowerings, _lowered_name(module))
    index = compile_.register(check, batch_dims)
    _custom_call.emit(ctx, value, compile_, index, check.mesh)
    return []


# Registered here, not with the primitive: the lowering is where a check meets its
# compile (this module's registry) and its custom call. Not cacheable: every check
# is a different `check` parameter, so JAX's lowering cache (JAX 0.9+) never hits,
# and each miss emitted the rule as a function of its own before inlining it:
# 0.2 ms a check, 20 ms of a 100-check lowering (figure 5 of benchmarks/). Lowered
# inline, the rule also runs for every equation, which registering needs.
_CACHEABLE = "cacheable" in inspect.signature(mlir.register_lowering).parameters
_NOT_CACHEABLE: dict[str, Any] = {"cacheable": False} if _CACHEABLE else {}
mlir.register_lowering(_primitive.check_sharding_p, _lower, **_NOT_CACHEABLE)


def _lowered_name(module_context: Any) -> str:
    """The name of the module being lowered, as in `jit_train_step`."""
    try:
        attribute = module_context.module.operation.attributes["sym_name"]
        return str(attribute).strip('"')
    except Exception:  # pragma: no cover - a JAX that names modules elsewhere
        return "the function"
