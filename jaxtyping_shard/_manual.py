"""Inside `shard_map`: values are local shards, mesh axes are `Manual`.

An annotation there describes the *global* array: its dims are checked against the
local shape times the sizes of the manual mesh axes the spec splits each dim over,
and the axes the value varies over must be exactly the manual axes the spec names.
"""

from typing import Any, Optional

import jax
from jax.sharding import AxisType

from . import _compat, _mesh, _spec


class GlobalView:
    """A stand-in with the global shape, for jaxtyping's shape check."""

    __slots__ = ("shape", "dtype", "local_shape", "mesh")

    def __init__(self, shape, dtype, local_shape, mesh):
        self.shape = shape
        self.dtype = dtype
        self.local_shape = local_shape
        self.mesh = mesh


def _manual_mesh(aval: Any) -> Optional[Any]:
    mesh = _mesh.of_aval(aval)
    if mesh is None or AxisType.Manual not in mesh.axis_types:
        return None
    return mesh


def global_view(cls: Any, obj: Any) -> Optional[GlobalView]:
    """The global shape of a local shard, or `None` outside `shard_map`."""
    aval = jax.typeof(obj)
    mesh = _manual_mesh(aval)
    if mesh is None:
        return None
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    sizes = _mesh.sizes(mesh)
    local = tuple(aval.shape)
    if cls._jts.min_rank > len(local):
        return None  # the sharding check reports the rank problem
    entries = cls._jts.entries(len(local))
    shape = list(local)
    for i, entry in enumerate(entries):
        for axis in entry:
            if axis in manual:
                shape[i] *= sizes[axis]
    return GlobalView(tuple(shape), aval.dtype, local, mesh)


def explain_shape(cls: Any, view: GlobalView, message: str) -> str:
    if not message:
        return ""
    local = _spec.format_array(view.dtype, view.local_shape, ())
    glob = _spec.format_array(view.dtype, view.shape, ())
    return (
        f"{message} (inside shard_map this annotation describes the global array: "
        f"the local shard `{local}` times the sizes of the manual mesh axes in "
        f"{cls._jts.text} on mesh {_mesh.format_mesh(view.mesh)} gives `{glob}`)"
    )


def check_manual(cls: Any, obj: Any, aval: Any, mesh: Any, manual: frozenset) -> str:
    sizes = _mesh.sizes(mesh)
    ndim = len(aval.shape)
    want = {a for a in cls._jts.axes if a in manual and sizes[a] > 1}
    varying = {a for a in _compat.varying_axes(aval) if sizes.get(a, 1) > 1}
    if want != varying and _compat.vma_tracked():
        missing = sorted(want - varying)
        extra = sorted(varying - want)
        reasons = []
        if missing:
            reasons.append(
                f"it does not vary over {_names(missing)} (is it the result of a "
                "`psum`/`all_gather` over it? then it is replicated, not sharded)"
            )
        if extra:
            reasons.append(
                f"it varies over {_names(extra)}, which the spec does not shard over "
                "(a per-device partial result needs a `psum`; a shard needs the "
                "axis in the spec)"
            )
        return (
            f"this local shard `{aval.str_short()}` inside shard_map does not match "
            f"{cls._jts.text} from the type hint: {'; '.join(reasons)} "
            f"(mesh {_mesh.format_mesh(mesh)})"
        )
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    if explicit:
        sharding = aval.sharding
        got = _spec.normalise(_spec.entries_of(sharding.spec), ndim, sizes, explicit)
        expected = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, explicit)
        if got != expected:
            return (
                f"this value inside shard_map is sharded as `{aval.str_short()}` "
                f"over the non-manual axes, not as {cls._jts.text} from the type "
                f"hint (mesh {_mesh.format_mesh(mesh)})"
            )
    return ""


def _names(axes: list) -> str:
    return ", ".join(repr(a) for a in axes)
