"""`isinstance(x, A)` for a sharded annotation `A`: the eager hot path.

What `isinstance` (so beartype) calls, as shallow as jaxtyping's own. There is
one function for each state of the mode, and the one in force is the
metaclass's `__instancecheck__`, swapped when the state changes
(`_core.modes.mode_flags`, told before any thread can see the new mode), so
that no check asks which state it is in:

- `while_off_nowhere`: no thread can be in mode "off" (the default). A cached
  pass costs one read of the array's sharding and nothing else.
- `while_off_everywhere`: every thread is in mode "off" (`JAXTYPING_SHARD_MODE=off`,
  or `set_mode("off")` as the default, no other scope open). jaxtyping's check
  and nothing else.
- `while_modes_vary`: threads may be in different modes (a `with set_mode(...)`
  scope of another mode than the default is open somewhere). Each check reads
  its own thread's mode from JAX's thread-local state, as JAX's cache key does.

A tracer takes `_not_an_array`: on a mesh whose axes are all Explicit, a type
(`obj.aval`) the annotation passed before costs a dict lookup and jaxtyping's
check (see `keep_traced`, below, and benchmarks/README.md, "Figure 6").

Each step is counted in machine instructions in benchmarks/README.md ("Figures
1, 2, 5 and 16, measured"). A `jax.Array` is told by its class
(`isinstance(obj, Tracer)` and `.sharding` cost 4x that). jaxtyping's check
runs on the unsharded base (same dims; transparent after `make_transparent`),
not through our `_check_shape`, which only tracers need.
"""

from typing import Any

import jax
import jaxtyping
from jax.core import Tracer

from .._core.compat import ARRAY_IMPL
from .._core.modes import mode_reader
from .._rules.scope import current as _current_rules


# jaxtyping's metaclass is not exported; take it from a public object.
JaxtypingArrayMeta: Any = type(jaxtyping.Shaped[jax.Array, "..."])
_jaxtyping_instancecheck_str = JaxtypingArrayMeta.__instancecheck_str__


def while_off_nowhere(cls: Any, obj: Any) -> bool:
    if obj.__class__ is ARRAY_IMPL:
        if _jaxtyping_instancecheck_str(cls._jts_base, obj):
            return False
        # The sharding object this annotation last accepted: arrays share their
        # sharding object, so `is` beats hashing (`_sharding` is a C++ property).
        if obj._sharding is cls._jts_last:
            return True
        return cls._jts_sharding_str(obj) == ""
    return _not_an_array(cls, obj)


def while_off_everywhere(cls: Any, obj: Any) -> bool:
    if obj.__class__ is ARRAY_IMPL:
        return not _jaxtyping_instancecheck_str(cls._jts_base, obj)
    return _not_an_array(cls, obj)


def while_modes_vary(cls: Any, obj: Any) -> bool:
    if obj.__class__ is ARRAY_IMPL:
        if _jaxtyping_instancecheck_str(cls._jts_base, obj):
            return False
        # The mode first (JAX's `.value`, a C++ read of thread-local state): in
        # mode "off" the sharding is never read.
        if mode_reader.value == "off" or obj._sharding is cls._jts_last:
            return True
        return cls._jts_sharding_str(obj) == ""
    return _not_an_array(cls, obj)


def _not_an_array(cls: Any, obj: Any) -> bool:
    """A tracer, a NumPy array, anything else: the general path, in any state."""
    if isinstance(obj, Tracer):
        # A type this annotation has passed on an Explicit mesh: jaxtyping's
        # check (its dims bound in the memo) is all that is left to do.
        aval = obj.aval
        key = (aval, _current_rules()) if cls._jts_logical else aval
        if key in cls._jts_traced:
            return not _jaxtyping_instancecheck_str(cls._jts_base, obj)
        return cls.__instancecheck_str__(obj) == ""
    if cls._skip_instancecheck:
        return True
    if _jaxtyping_instancecheck_str(cls._jts_base, obj):
        return False
    try:
        if obj.sharding is cls._jts_last:
            return True
    except AttributeError:  # a NumPy array, say: it lives on one device
        pass
    if mode_reader.value == "off":
        return True
    return cls._jts_sharding_str(obj) == ""


# Trace time. A traced value's type (`obj.aval`: its shape, dtype and sharding,
# whose mesh carries its axis names, sizes and types) is interned by JAX and
# hashes from a cached hash. On a mesh whose axes are all Explicit the verdict
# is a function of that type alone (and, for a logical annotation, of the rules
# table that resolves it), so a pass is kept per annotation under that key: a
# new mesh, spec, shape or table is a new key, and the mode decides only what
# a failure does (failures are never kept). Auto axes (the verdict is XLA's,
# scheduled per value) and Manual ones (`shard_map`: the dims are the global
# array's) are never kept. The passes are also kept by layout, for every
# annotation (`_SHARED`): a model's fields are as many annotations, of a few
# layouts, each checked once a trace (the verdict reads only the layout;
# jaxtyping's dtype and dims check is each annotation's own, and still runs).
_TRACED_LIMIT = 1024
_SHARED: dict = {}  # (layout, key): a pass of any annotation of that layout
_SHARED_LIMIT = 4096


def traced_key(cls: Any, obj: Any) -> Any:
    """The key of a tracer's verdict against `cls` in `cls._jts_traced`."""
    return (obj.aval, _current_rules()) if cls._jts_logical else obj.aval


def kept(cls: Any, obj: Any) -> bool:
    """Whether `cls` (any annotation) passed the tracer `obj`'s type before."""
    traced = getattr(cls, "_jts_traced", None)
    return traced is not None and traced_key(cls, obj) in traced


def keep_traced(cls: Any, key: Any, aval: Any) -> str:
    """Keeps a pass of a tracer against `cls` (see above), on an Explicit mesh
    and when the mode is not "warn" (where a failure, warned, also reads "");
    returns "" (the verdict)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or mode_reader.value == "warn":
        return ""
    if any(t != _EXPLICIT for t in mesh.axis_types):
        return ""
    _keep(cls._jts_traced, key, _TRACED_LIMIT)
    _keep(_SHARED, (cls._jts, key), _SHARED_LIMIT)
    return ""


def kept_elsewhere(cls: Any, key: Any) -> bool:
    """Whether an annotation of `cls`'s layout passed this type (then kept by
    `cls` too)."""
    if (cls._jts, key) not in _SHARED:
        return False
    _keep(cls._jts_traced, key, _TRACED_LIMIT)
    return True


def _keep(kept: dict, key: Any, limit: int) -> None:
    if len(kept) >= limit:
        kept.clear()
    kept[key] = True


_EXPLICIT = jax.sharding.AxisType.Explicit


def for_flags(flags: Any) -> Any:
    """The `__instancecheck__` for the state `flags` (a `_ModeFlags`) describes."""
    if flags.off_nowhere:
        return while_off_nowhere
    if flags.off_everywhere:
        return while_off_everywhere
    return while_modes_vary
