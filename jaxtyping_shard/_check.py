"""The verdict: does a value's sharding match its annotation's spec?

Four paths, by what is known about the value:

- a concrete `jax.Array`: its `.sharding`, compared with `Sharding.is_equivalent_to`
  and cached per annotation;
- a tracer whose mesh axes are `Explicit`: `jax.typeof(x).sharding`, at trace time;
- a tracer whose mesh has `Auto` axes: `jax.typeof` cannot tell, so a
  `jax.debug.inspect_array_sharding` callback checks when XLA compiles;
- a value with no sharding at all (NumPy arrays): it is on one device.
"""

import itertools
import threading
import warnings
from collections import OrderedDict
from typing import Any, Optional

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding

from . import _mesh, _spec
from ._config import state
from ._errors import (
    ShardingAnnotationError,
    ShardingTypeCheckError,
    ShardingWarning,
)
from ._report import report
from ._site import find_site, how_traced


_CACHE_LIMIT = 4096
_FIX = (
    "If the array is right and the annotation wrong, change the annotation; "
    "otherwise place the array with "
    "`jax.device_put(x, NamedSharding(mesh, spec))` or, inside `jit`, "
    "`jax.sharding.reshard` / `jax.lax.with_sharding_constraint`."
)


def check(cls: Any, obj: Any) -> str:
    """Returns "" when `obj`'s sharding matches `cls`'s spec, else the reason."""
    # Tracers first: a tracer's `.sharding` raises an AttributeError whose message
    # walks the whole jaxpr traced so far (O(n) per check, O(n^2) per function).
    if isinstance(obj, Tracer):
        return _report(_check_tracer(cls, obj), cls, obj)
    sharding = getattr(obj, "sharding", None)
    if sharding is None:
        return _report(_check_unsharded(cls, obj), cls, obj)
    cache = cls._jts_verdicts
    if type(sharding) is NamedSharding:
        key = sharding if cls._jts_rank_fixed else (sharding, len(obj.shape))
    else:
        key = (sharding, len(obj.shape), _mesh.context_mesh())
    verdict = cache.get(key)
    if verdict is None:
        verdict = _eager_verdict(cls, sharding, len(obj.shape))
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = verdict
    if verdict:
        if type(sharding) is NamedSharding and cls._jts_rank_fixed:
            cls._jts_last = sharding  # see _MetaShardedArray.__instancecheck_str__
        return ""
    return _report(_eager_message(cls, obj, sharding), cls, obj)


def _report(message: str, cls: Any, obj: Any) -> str:
    return report(message, cls, obj, state.mode) if message else ""


def _check_axes(cls: Any, mesh: Any) -> None:
    """Raises if the spec names an axis that the mesh lacks."""
    names = set(mesh.axis_names)
    for axis in cls._jts.axes:
        if axis not in names:
            axes = ", ".join(repr(a) for a in mesh.axis_names) or "none"
            raise ShardingAnnotationError(
                f"The type hint {cls._jts.text} names mesh axis {axis!r}, but "
                f"the mesh {_mesh.format_mesh(mesh)} has axes {axes}. Fix the "
                "axis name in the annotation, or check the array is placed on the "
                "mesh you meant."
            )


def _too_long(cls: Any, ndim: int) -> str:
    if cls._jts.min_rank > ndim:
        return (
            f"this array has {ndim} dimensions, fewer than the "
            f"{cls._jts.min_rank} sharded dims of {cls._jts.text} in the type hint"
        )
    return ""


def _shards_nothing(cls: Any, mesh: Optional[Any]) -> bool:
    if not cls._jts.axes:
        return True
    if mesh is None:
        return False
    sizes = _mesh.sizes(mesh)
    return all(sizes.get(a, 1) == 1 for a in cls._jts.axes)


def _equivalent(cls: Any, mesh: Any, sharding: Any, ndim: int) -> bool:
    """JAX's verdict: is `sharding` the annotation's spec on `mesh`?"""
    expected = NamedSharding(
        mesh, cls._jts.spec(ndim), memory_kind=sharding.memory_kind
    )
    return expected.is_equivalent_to(sharding, ndim)


def _eager_verdict(cls: Any, sharding: Any, ndim: int) -> bool:
    if _too_long(cls, ndim):
        return False
    if type(sharding) is NamedSharding:
        _check_axes(cls, sharding.mesh)
        return _equivalent(cls, sharding.mesh, sharding, ndim)
    mesh = _mesh.context_mesh()
    if mesh is not None:
        _check_axes(cls, mesh)
    if len(sharding.device_set) == 1:
        # One device: only a spec that shards nothing describes it.
        return _shards_nothing(cls, mesh)
    if isinstance(mesh, jax.sharding.Mesh):
        return _equivalent(cls, mesh, sharding, ndim)
    return sharding.is_fully_replicated and _shards_nothing(cls, mesh)


def _eager_message(cls: Any, obj: Any, sharding: Any) -> str:
    ndim = len(obj.shape)
    too_long = _too_long(cls, ndim)
    if too_long:
        return too_long
    if type(sharding) is NamedSharding:
        mesh = sharding.mesh
        actual = _spec.format_array(
            obj.dtype, obj.shape, _spec.entries_of(sharding.spec)
        )
        return (
            f"this array is sharded as `{actual}`, not {cls._jts.text} as "
            f"expected by the type hint (mesh {_mesh.format_mesh(mesh)}). {_FIX}"
        )
    plain = _spec.format_array(obj.dtype, obj.shape, ())
    mesh = _mesh.context_mesh()
    if len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        where = f"on the single device {device}"
    else:
        where = f"with {sharding}"
    extra = (
        f" (context mesh {_mesh.format_mesh(mesh)})"
        if mesh is not None
        else "; no mesh is set, so it cannot be sharded over named mesh axes"
    )
    return (
        f"this array `{plain}` lives {where}, not sharded as {cls._jts.text} as "
        f"expected by the type hint{extra}. {_FIX}"
    )


def _check_unsharded(cls: Any, obj: Any) -> str:
    if _too_long(cls, len(obj.shape)):
        return _too_long(cls, len(obj.shape))
    mesh = _mesh.context_mesh()
    if mesh is not None:
        _check_axes(cls, mesh)
    if _shards_nothing(cls, mesh):
        return ""
    return (
        f"this value is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"lives on one device, not sharded as {cls._jts.text} as expected by "
        "the type hint. Convert it with `jax.device_put(x, NamedSharding(mesh, "
        "spec))` first."
    )


_NOUNS = {
    "traced": "this traced {}",
    "differentiated": "this {}, differentiated by `grad`/`jvp`/`vjp` outside `jit`,",
    "vmapped": "this {}, batched by `vmap` outside `jit`,",
    "transformed": "this {}, inside a JAX transformation outside `jit`,",
}


def _noun(obj: Any, what: str = "array") -> str:
    """"this traced array" under `jit`; what else it is under `grad` or `vmap`."""
    return _NOUNS[how_traced(obj)].format(what)


def _when(obj: Any) -> str:
    return "; checked at trace time" if how_traced(obj) == "traced" else ""


def _check_tracer(cls: Any, obj: Any) -> str:
    aval = jax.typeof(obj)
    ndim = len(aval.shape)
    too_long = _too_long(cls, ndim)
    if too_long:
        return too_long
    sharding = getattr(aval, "sharding", None)
    mesh = _mesh.of_aval(aval)
    if mesh is None:
        if _shards_nothing(cls, None):
            return ""
        return (
            f"{_noun(obj, 'value')} `{aval.str_short()}` has no mesh (none in its "
            "type, none set with `jax.set_mesh`), so it cannot be sharded as "
            f"{cls._jts.text} as expected by the type hint. Pass arrays placed "
            "on a mesh, or call under `jax.set_mesh(mesh)`."
        )
    _check_axes(cls, mesh)
    sizes = _mesh.sizes(mesh)
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    auto = _mesh.names_of_type(mesh, AxisType.Auto)
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    if manual:
        from ._manual import check_manual

        return check_manual(cls, obj, aval, mesh, manual)
    actual = _spec.entries_of(sharding.spec) if sharding is not None else ()
    pending = _spec.pending_axes(sharding.spec) if sharding is not None else ()
    if pending:
        return (
            f"{_noun(obj)} `{aval.str_short()}` is unreduced over "
            f"{', '.join(repr(a) for a in sorted(pending))} (a sum is still pending), "
            f"not laid out as {cls._jts.text} as expected by the type hint (mesh "
            f"{_mesh.format_mesh(mesh)}). Reduce it first, e.g. with "
            "`jax.sharding.reshard`."
        )
    if explicit:
        want = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, explicit)
        got = _spec.normalise(actual, ndim, sizes, explicit)
        if want != got:
            return (
                f"{_noun(obj)} is sharded as `{aval.str_short()}`, not "
                f"{cls._jts.text} as expected by the type hint (mesh "
                f"{_mesh.format_mesh(mesh)}{_when(obj)}). {_FIX}"
            )
    if any(sizes[a] > 1 for a in auto):
        schedule_compile_check(cls, obj, aval, mesh)
    return ""


_scheduled: "OrderedDict[tuple[int, int], Any]" = OrderedDict()
_scheduled_lock = threading.Lock()


def under_vmap(obj: Any) -> bool:
    """Whether `obj` is traced under `vmap`, directly or through an inner `jit`.

    Under vmap, `jax.debug.inspect_array_sharding` reports the sharding of the
    *batched* array, with the batch dim at an unknown position, so it cannot be
    compared with a per-example annotation. No public API tells whether a trace is
    batched; this walks the tracer's trace and its parents (JAX internals: a
    `BatchTrace`, and `DynamicJaxprTrace.parent_trace`), and only ever serves to
    *skip* a compile-time check, never to pass one.
    """
    trace = getattr(obj, "_trace", None)
    for _ in range(64):  # bounded: traces nest only as deep as transformations
        if trace is None:
            return False
        if type(trace).__name__ == "BatchTrace":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


class _Phase(threading.local):
    # False: schedule compile-time checks as usual. True: `jaxtyping_shard.jit` is
    # tracing its unchecked twin, for inputs whose checks have already run.
    skip: bool = False


phase = _Phase()


def schedule_compile_check(cls: Any, obj: Any, aval: Any, mesh: Any) -> None:
    """Checks `obj`'s sharding once XLA has chosen it (`Auto` mesh axes)."""
    if under_vmap(obj):
        return  # documented in docs/guarantees.md: not checkable under vmap
    if phase.skip:
        return
    key = (id(obj), id(cls))
    with _scheduled_lock:
        if key in _scheduled:
            return  # jaxtyped re-checks parameters along with the return value
        # Holding `obj` keeps its id from being reused while the key is here.
        _scheduled[key] = (obj, cls)
        if len(_scheduled) > 64:  # spans a jaxtyped call; keeps few tracers alive
            _scheduled.popitem(last=False)
    site = find_site(obj)
    callback = _CompileTimeCheck(cls, aval, mesh, site)
    jax.debug.inspect_array_sharding(obj, callback=callback)


_failures: "OrderedDict[int, ShardingTypeCheckError]" = OrderedDict()
_failures_lock = threading.Lock()
_failure_ids = itertools.count(1)
MARKER = "[jaxtyping_shard #{}]"


class _CompileTimeCheck:
    # No __slots__: JAX holds primitive callbacks by weak reference.

    def __init__(self, cls, aval, mesh, site):
        self.cls = cls
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype
        self.mesh = mesh
        self.site = site

    def __call__(self, sharding: Any) -> None:
        ndim = len(self.shape)
        cls = self.cls
        if type(sharding) is NamedSharding:
            ok = _equivalent(cls, sharding.mesh, sharding, ndim)
            actual = _spec.format_array(
                self.dtype, self.shape, _spec.entries_of(sharding.spec)
            )
        else:
            # Not on a mesh (XLA found no NamedSharding to report): only a spec
            # that shards nothing on this mesh can describe a replicated value.
            ok = sharding.is_fully_replicated and _shards_nothing(cls, self.mesh)
            actual = f"{_spec.format_array(self.dtype, self.shape, ())} ({sharding})"
        if ok:
            return
        message = (
            f"{self.site.describe()}: XLA sharded it as `{actual}`, not "
            f"{cls._jts.text} as expected by the type hint {cls.__name__} "
            f"(mesh {_mesh.format_mesh(self.mesh)}; checked when the function was "
            f"compiled). {_FIX}"
        )
        if state.mode == "warn":
            warnings.warn(message, ShardingWarning, stacklevel=2)
            return
        if state.mode == "off":
            return
        failure_id = next(_failure_ids)
        error = ShardingTypeCheckError(f"{message} {MARKER.format(failure_id)}")
        with _failures_lock:
            _failures[failure_id] = error
            if len(_failures) > 64:
                _failures.popitem(last=False)
        # JAX wraps this as `JaxRuntimeError: INTERNAL: ...`; `sharding_errors`
        # and `jaxtyping_shard.jit` turn it back into this error.
        raise error


def pop_failure(failure_id: int) -> Optional[ShardingTypeCheckError]:
    with _failures_lock:
        return _failures.pop(failure_id, None)
