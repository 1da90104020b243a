"""The verdict: does a value's sharding match its annotation's spec?

Four paths, by what is known about the value:

- a concrete `jax.Array`: its `.sharding`, compared with `Sharding.is_equivalent_to`
  and cached per annotation;
- a tracer whose mesh axes are `Explicit`: `jax.typeof(x).sharding`, at trace time;
- a tracer whose mesh has `Auto` axes: `jax.typeof` cannot tell, so a
  `jts_check_sharding` primitive checks when XLA compiles (`auto`);
- a value with no sharding at all (NumPy arrays): it is on one device.
"""

from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding

from .._core import mesh as _mesh
from .._core.failures import report
from .._core.modes import current_mode
from .._core.site import how_traced
from .._layout import spec as _spec
from . import auto as _auto, union as _union
from .compare import (
    agrees,
    contrast,
    empty_fits,
    equivalent,
    FIX as _FIX,
    missing_axes,
    same_mesh_shape,
    shards_nothing,
    too_long,
)
from .constraints import constrained_spec
from .manual import check_manual


_CACHE_LIMIT = 4096


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
        key = (sharding, len(obj.shape), _mesh.concrete_context_mesh())
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
    if empty_fits(cls, obj.shape):
        return ""
    return _report(_eager_message(cls, obj, sharding), cls, obj)


def _report(message: str, cls: Any, obj: Any) -> str:
    if not message:
        return ""
    mode = current_mode()
    if mode == "warn" and _another_member_matches(cls, obj):
        return message  # the checker moves on to that member of the Union
    return report(message, cls, obj, mode)


def _another_member_matches(cls: Any, obj: Any) -> bool:
    """Whether `obj` is checked against a Union of which another member accepts it.

    Checked without side effects (no warning, nothing scheduled); a member whose
    verdict waits for XLA counts as accepting: its own check then runs.
    """
    members = _union.other_members(cls, obj)
    if members.unconditional:
        return True
    for member in members:
        if isinstance(obj, Tracer):
            message = _check_tracer(member, obj, schedule=False)
        elif getattr(obj, "sharding", None) is None:
            message = _check_unsharded(member, obj)
        else:
            ok = _eager_verdict(member, obj.sharding, len(obj.shape))
            message = "" if ok else "no"
        if not message:
            return True
    return False


def _eager_verdict(cls: Any, sharding: Any, ndim: int) -> bool:
    if too_long(cls, ndim):
        return False
    target = getattr(cls, "_jts_target", None)
    if target is not None:
        return agrees(sharding, target, ndim)  # devices and memory kind too
    if type(sharding) is NamedSharding:
        if missing_axes(cls, sharding.mesh):
            return False
        return equivalent(cls, sharding.mesh, sharding, ndim)
    mesh = _mesh.concrete_context_mesh()
    if mesh is not None and missing_axes(cls, mesh):
        return False
    if len(sharding.device_set) == 1:
        # One device: only a spec that shards nothing describes it.
        return shards_nothing(cls, mesh)
    if isinstance(mesh, jax.sharding.Mesh):
        return equivalent(cls, mesh, sharding, ndim)
    return sharding.is_fully_replicated and shards_nothing(cls, mesh)


def _target_message(cls: Any, obj: Any, sharding: Any, target: Any) -> str:
    ndim = len(obj.shape)
    actual, expected, there = contrast(
        sharding, target, obj.dtype, obj.shape, cls._jts.entries(ndim)
    )
    extra = "" if hasattr(target, "mesh") else f" ({target})"
    return (
        f"this array is {actual}, not {expected}{there} as expected by "
        f"{cls._jts.text}{extra}. {_FIX}"
    )


def _eager_message(cls: Any, obj: Any, sharding: Any) -> str:
    ndim = len(obj.shape)
    short = too_long(cls, ndim)
    if short:
        return short
    target = getattr(cls, "_jts_target", None)
    if target is not None:
        return _target_message(cls, obj, sharding, target)
    if type(sharding) is NamedSharding:
        mesh = sharding.mesh
        missing = missing_axes(cls, mesh)
        if missing:
            return missing
        actual = _spec.format_array(
            obj.dtype, obj.shape, _spec.entries_of(sharding.spec)
        )
        return (
            f"this array is sharded as `{actual}`, not {cls._jts.text} as "
            f"expected by the type hint (mesh {_mesh.format_mesh(mesh)}). {_FIX}"
        )
    plain = _spec.format_array(obj.dtype, obj.shape, ())
    mesh = _mesh.concrete_context_mesh()
    missing = missing_axes(cls, mesh) if mesh is not None else ""
    if missing:
        return missing
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
    if too_long(cls, len(obj.shape)):
        return too_long(cls, len(obj.shape))
    mesh = _mesh.context_mesh()
    missing = missing_axes(cls, mesh) if mesh is not None else ""
    if missing:
        return missing
    if shards_nothing(cls, mesh) or empty_fits(cls, obj.shape):
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
    """ "this traced array" under `jit`; what else it is under `grad` or `vmap`."""
    return _NOUNS[how_traced(obj)].format(what)


def _when(obj: Any) -> str:
    return "; checked at trace time" if how_traced(obj) == "traced" else ""


def _check_tracer(cls: Any, obj: Any, schedule: bool = True) -> str:
    aval = jax.typeof(obj)
    ndim = len(aval.shape)
    short = too_long(cls, ndim)
    if short:
        return short
    sharding = getattr(aval, "sharding", None)
    mesh = _mesh.of_aval(aval)
    if mesh is None:
        if shards_nothing(cls, None):
            return ""
        return (
            f"{_noun(obj, 'value')} `{aval.str_short()}` has no mesh (none in its "
            "type, none set with `jax.set_mesh`), so it cannot be sharded as "
            f"{cls._jts.text} as expected by the type hint. Pass arrays placed "
            "on a mesh, or call under `jax.set_mesh(mesh)`."
        )
    missing = missing_axes(cls, mesh)
    if missing:
        return missing
    # Against a concrete sharding: a trace knows no devices, only the mesh's shape.
    target_mesh = getattr(getattr(cls, "_jts_target", None), "mesh", None)
    if target_mesh is not None and not same_mesh_shape(mesh, target_mesh):
        return (
            f"{_noun(obj)} `{aval.str_short()}` is on the mesh "
            f"{_mesh.format_mesh(mesh)}, not on the mesh of {cls._jts.text} "
            f"({_mesh.format_mesh(target_mesh)}) as expected{_when(obj)}"
        )
    sizes = _mesh.sizes(mesh)
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    auto = _mesh.names_of_type(mesh, AxisType.Auto)
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    if manual:
        return check_manual(cls, obj, aval, mesh, manual)
    actual = _spec.entries_of(sharding.spec) if sharding is not None else ()
    # `reduced` axes are laid out like replicated ones (JAX and the eager verdict
    # agree); only `unreduced` ones hold a pending sum.
    pending = _spec.unreduced_axes(sharding.spec) if sharding is not None else ()
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
        if want != got and not empty_fits(cls, aval.shape):
            return (
                f"{_noun(obj)} is sharded as `{aval.str_short()}`, not "
                f"{cls._jts.text} as expected by the type hint (mesh "
                f"{_mesh.format_mesh(mesh)}{_when(obj)}). {_FIX}"
            )
    constrained = _constrained(cls, obj, aval, mesh, sizes, auto) if auto else ""
    if constrained:
        return constrained
    if schedule and any(sizes[a] > 1 for a in auto):
        # In a Union, any member whose shape fits may be the one XLA's layout
        # matches (beartype and typeguard stop at the first that passes).
        members = _union.other_members(cls, obj)
        if members.unconditional:
            return ""  # a member without a sharding accepts the value
        members = tuple(m for m in members if not missing_axes(m, mesh))
        _auto.schedule(cls, obj, aval, mesh, current_mode(), members)
    return ""


def _constrained(cls: Any, obj: Any, aval: Any, mesh: Any, sizes: dict, auto) -> str:
    """The verdict, at trace time, on a value `jts.reshard` constrained (Auto axes).

    XLA must lay such a value out as constrained, so its check need not wait for
    the compile, and the culprit is reported where the constraint is, before the
    values XLA would propagate the layout to.
    """
    spec = constrained_spec(obj)
    if spec is None:
        return ""
    ndim = len(aval.shape)
    got = _spec.entries_of(spec)
    want = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, auto)
    if want == _spec.normalise(got, ndim, sizes, auto) or empty_fits(cls, aval.shape):
        return ""
    members = _union.other_members(cls, obj)
    if members or members.unconditional:
        return ""  # another member of a Union may accept it: left to the compile
    shown = _spec.format_array(aval.dtype, aval.shape, got)
    return (
        f"{_noun(obj)} is laid out as `{shown}` by `jts.reshard` (a constraint XLA "
        f"keeps), not {cls._jts.text} as expected by the type hint (mesh "
        f"{_mesh.format_mesh(mesh)}{_when(obj)}). {_FIX}"
    )
