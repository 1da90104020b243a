"""The verdict on a value with a concrete sharding (or none: a NumPy array lives
on one device), and the message when it fails: eager checks, and the
`SpecCheck`s of `check_tree` leaves."""

from typing import Any

import jax
from jax.sharding import NamedSharding

from .._core import mesh as _mesh
from .._layout import spec as _spec
from .compare import (
    agrees,
    contrast,
    empty_fits,
    equivalent,
    FIX as _FIX,
    missing_axes,
    pending_mismatch,
    pending_refused,
    shards_nothing,
    target_types_clash,
    too_long,
    types_message,
)


def eager_verdict(cls: Any, sharding: Any, ndim: int) -> bool:
    if too_long(cls, ndim):
        return False
    target = getattr(cls, "_jts_target", None)
    if target is not None:
        mesh = getattr(target, "mesh", None)
        if target_types_clash(getattr(sharding, "mesh", None), mesh):
            return False  # an Explicit target: its axis types are asked for
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
    mesh, target_mesh = getattr(sharding, "mesh", None), getattr(target, "mesh", None)
    if target_types_clash(mesh, target_mesh) and agrees(sharding, target, ndim):
        return types_message(
            "this array", mesh, target_mesh, f"the mesh of {cls._jts.text}"
        )
    actual, expected, there = contrast(
        sharding, target, obj.dtype, obj.shape, cls._jts.entries(ndim)
    )
    extra = "" if hasattr(target, "mesh") else f" ({target})"
    return (
        f"this array is {actual}, not {expected}{there} as expected by "
        f"{cls._jts.text}{extra}. {_FIX}"
    )


def eager_message(cls: Any, obj: Any, sharding: Any) -> str:
    ndim = len(obj.shape)
    short = too_long(cls, ndim)
    if short:
        return short
    target = getattr(cls, "_jts_target", None)
    if target is not None:
        return _target_message(cls, obj, sharding, target)
    if type(sharding) is NamedSharding:
        mesh = sharding.mesh
        missing = missing_axes(cls, mesh) or pending_refused(cls, mesh)
        if missing:
            return missing
        actual = _spec.format_array(
            obj.dtype, obj.shape, _spec.entries_of(sharding.spec), sharding.spec
        )
        differs, fix = pending_mismatch(cls, sharding.spec, _mesh.sizes(mesh))
        if differs:
            mesh_text = _mesh.format_mesh(mesh)
            return f"this array `{actual}` is {differs} (mesh {mesh_text}). {fix}"
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


def check_unsharded(cls: Any, obj: Any) -> str:
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
