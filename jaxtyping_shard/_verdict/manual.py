"""Inside `shard_map`: values are local shards, mesh axes are `Manual`.

An annotation there describes the *global* array: its dims are checked against the
local shape times the sizes of the manual mesh axes the spec splits each dim over,
and the axes the value varies over must be exactly the manual axes the spec names.
For the body's arguments, the `in_specs` also say which dim each manual axis
splits, in which order: those are compared too. Any other value has no global
layout until `out_specs` gives it one, after the body returns (see
docs/guarantees.md).
"""

import sys
from typing import Any, Optional

import jax
from jax.sharding import AxisType

from .._core import compat as _compat, mesh as _mesh
from .._layout import spec as _spec


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


# The frames of JAX that call a shard_map body's tracing with its `in_specs` as a
# local: jit / staged (`_shard_map_staging`) and eager (`_run_shmap` under
# `_shard_map_impl`). The frame they call, which owns the body's trace, is named
# differently in every release (`trace_to_jaxpr_dynamic` in 0.8, `trace_to_jaxpr`
# in 0.10, `trace_to_jaxpr_nocache` in 0.12, `_run_shmap` eager), so it is found
# by the trace it holds, not by its name, among the few frames just below.
_SPEC_FRAMES = frozenset({"_shard_map_staging", "_shard_map_impl"})
# How far below that caller the owner may be: JAX 0.8 puts a profiler `wrapper`
# frame in between.
_OWNER_DEPTH = 3


def in_spec_of(obj: Any) -> Optional[Any]:
    """The `in_specs` entry a shard_map body's argument was split by; None for any
    other value (an intermediate, a value of a nested `jit`) or when not found.

    No public API says it: inside the body, `jax.typeof(x)` keeps only the
    non-manual axes of the spec. It is read from JAX's own frames: the trace that
    owns `obj` is a local `trace` of the frame tracing the body, whose caller holds
    `in_specs` (one per flattened argument, in the order of the trace's inputs).
    If JAX changes these frames, nothing is found and only the checks of
    `check_manual` that need no `in_specs` run (tests/test_shard_map_specs.py
    fails loudly on every supported release if that happens).
    """
    trace = getattr(obj, "_trace", None)
    if trace is None:
        return None
    below: list = []  # the last few frames walked, innermost first
    frame = sys._getframe(1)
    for _ in range(256):  # the body's own Python frames lie in between
        if frame is None:
            return None
        if frame.f_code.co_name in _SPEC_FRAMES:
            for owner in below:
                if owner.f_locals.get("trace") is trace:
                    return _pick(frame.f_locals.get("in_specs"), _arg_index(owner, obj))
        below = [frame, *below[: _OWNER_DEPTH - 1]]
        frame = frame.f_back
    return None


def _arg_index(frame: Any, obj: Any) -> Optional[int]:
    tracers = frame.f_locals.get("in_tracers") or ()
    index = next((i for i, t in enumerate(tracers) if t is obj), None)
    if index is not None:
        return index
    invars = getattr(getattr(obj._trace, "frame", None), "invars", None) or ()
    var = getattr(obj, "val", None)
    return next((i for i, v in enumerate(invars) if v is var), None)


def _pick(in_specs: Any, index: Optional[int]) -> Optional[Any]:
    if index is None or not isinstance(in_specs, tuple) or index >= len(in_specs):
        return None
    spec = in_specs[index]
    return spec if isinstance(spec, jax.sharding.PartitionSpec) else None


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
    in_spec = in_spec_of(obj)
    if in_spec is not None:
        split = _spec.normalise(_spec.entries_of(in_spec), ndim, sizes, manual)
        asked = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, manual)
        if split != asked:
            return (
                f"this shard_map argument `{aval.str_short()}` was split by "
                f"in_specs={_spec.format_spec(in_spec)}, which is not the layout "
                f"of {cls._jts.text} from the type hint over the manual axes "
                f"(mesh {_mesh.format_mesh(mesh)}). Make the in_specs and the "
                "annotation agree (`jaxtyping_shard.typed_shard_map` reads the "
                "in_specs from the annotations)."
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
