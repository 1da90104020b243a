"""What the verdicts share: comparing a layout with a sharding on a mesh.

The predicates every path uses (eager, trace time, compile time) so that all
reach the same verdict, and the fix every message ends with. `Sharding.
is_equivalent_to` decides; specs are never compared with `==`.
"""

from typing import Any, Optional

from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from .._core import mesh as _mesh
from .._layout import spec as _spec


FIX = (
    "If the array is right and the annotation wrong, change the annotation; "
    "otherwise place the array with "
    "`jax.device_put(x, NamedSharding(mesh, spec))` or, inside `jit`, "
    "`jax.sharding.reshard` / `jax.lax.with_sharding_constraint`."
)


def empty_fits(cls: Any, shape: Any) -> bool:
    """An array with no elements has no layout: every annotation of its rank fits.

    XLA reports such arrays as replicated whatever they were given, so this is the
    one verdict that eager, trace-time and compile-time checks can all agree on.
    """
    return 0 in shape and not too_long(cls, len(shape))


def missing_axes(cls: Any, mesh: Any) -> str:
    """Why the spec cannot describe an array on `mesh`: it names an axis the mesh
    lacks. Not an annotation error: inside a `Union`, an annotation for another
    mesh simply does not match (and `isinstance` says False)."""
    names = set(mesh.axis_names)
    for axis in cls._jts.axes:
        if axis not in names:
            axes = ", ".join(repr(a) for a in mesh.axis_names) or "none"
            return (
                f"the type hint {cls._jts.text} names mesh axis {axis!r}, but "
                f"the mesh {_mesh.format_mesh(mesh)} has axes {axes}. Fix the "
                "axis name in the annotation, or check the array is placed on the "
                "mesh you meant."
            )
    return ""


def too_long(cls: Any, ndim: int) -> str:
    if cls._jts.min_rank > ndim:
        return (
            f"this array has {ndim} dimensions, fewer than the "
            f"{cls._jts.min_rank} sharded dims of {cls._jts.text} in the type hint"
        )
    return ""


def shards_nothing(cls: Any, mesh: Optional[Any]) -> bool:
    if not cls._jts.axes:
        return True
    if mesh is None:
        return False
    sizes = _mesh.sizes(mesh)
    return all(sizes.get(a, 1) == 1 for a in cls._jts.axes)


def _names(axes: Any) -> str:
    return ", ".join(repr(a) for a in sorted(axes))


def pending_refused(cls: Any, mesh: Any) -> str:
    """Why the annotation's unreduced / reduced axes cannot be asked for on
    `mesh`: JAX has them on `Explicit` axes only (a `NamedSharding` refuses them
    on `Auto` ones), and inside `shard_map` they are not the value's type; ""
    when they can (or there are none)."""
    asked = cls._jts.unreduced | cls._jts.reduced
    if not asked:
        return ""
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    manual = {a for a in asked if types.get(a) == AxisType.Manual}
    auto = {a for a in asked if types.get(a) == AxisType.Auto}
    if manual:
        return (
            f"the type hint {cls._jts.text} asks for a value unreduced or reduced "
            f"over {_names(manual)}, manual axes here (inside `shard_map`): "
            "jaxtyping_shard checks unreduced and reduced on `Explicit` axes, where "
            "they are part of the value's type; inside `shard_map` a pending sum is "
            "the body's own (`jax.lax.psum`). Annotate the body's values without "
            "them, and the values outside `shard_map` with them."
        )
    if auto:
        return (
            f"the type hint {cls._jts.text} asks for a value unreduced or reduced "
            f"over {_names(auto)}, `Auto` axes of the mesh "
            f"{_mesh.format_mesh(mesh)}: JAX has unreduced and reduced values only "
            "on `Explicit` axes (on `Auto` ones XLA decides where sums happen). "
            "Make those axes `Explicit` (`jax.make_mesh(..., axis_types=...)`), or "
            "annotate without `unreduced` / `reduced`."
        )
    return ""


def pending_mismatch(cls: Any, spec: Any, sizes: dict) -> tuple[str, str]:
    """How a value's unreduced / reduced axes (`spec`'s) differ from those the
    annotation declares, and the fix; ("", "") when they agree. An unreduced
    value matches only an annotation with the same unreduced axes; a declared
    `reduced` must be there (an undeclared one is a replicated layout). Mesh
    axes of size 1 are dropped, as JAX does."""

    def kept(axes: Any) -> frozenset:
        return frozenset(a for a in axes if sizes.get(a, 1) != 1)

    got_u, want_u = kept(_spec.unreduced_axes(spec)), kept(cls._jts.unreduced)
    got_r, want_r = kept(_spec.reduced_axes(spec)), kept(cls._jts.reduced)
    text = cls._jts.text
    if got_u - want_u:
        return (
            f"unreduced over {_names(got_u - want_u)} (a sum is still pending), "
            f"which {text} in the type hint does not declare",
            "Reduce it first (`jax.sharding.reshard` to a spec without them), or "
            "declare it unreduced in the annotation.",
        )
    if want_u - got_u:
        return (
            f"not unreduced over {_names(want_u - got_u)} as {text} in the type "
            "hint declares: its sum was already taken (a reduction ran, or the "
            "unreduced tag was dropped)",
            "Keep it pending: make the value with "
            "`out_sharding=` that spec (`jts.out_sharding(...)`), and for a "
            "gradient mark the parameter `reduced` over those axes "
            "(`jax.sharding.reshard(w, P(..., reduced={...}))`).",
        )
    if want_r - got_r:
        return (
            f"not reduced over {_names(want_r - got_r)} as {text} in the type hint "
            "declares",
            "Mark it so, e.g. `jax.sharding.reshard(w, P(..., reduced={...}))` or "
            "`jts.reshard(w, annotation)`.",
        )
    return "", ""


def equivalent(cls: Any, mesh: Any, sharding: Any, ndim: int) -> bool:
    """JAX's verdict: is `sharding` the annotation's spec on `mesh`? (JAX's
    `is_equivalent_to` compares unreduced axes, not reduced ones: both are
    compared here.)"""
    if pending_refused(cls, mesh):
        return False
    spec = getattr(sharding, "spec", None)
    if pending_mismatch(cls, spec, _mesh.sizes(mesh))[0]:
        return False
    expected = NamedSharding(
        mesh, cls._jts.spec(ndim), memory_kind=sharding.memory_kind
    )
    if not isinstance(mesh, Mesh):
        # An abstract mesh has no devices, and JAX 0.8's `is_equivalent_to`
        # asks for them: compared by mesh shape and layout, as `agrees` does.
        return agrees(sharding, expected, ndim)
    return expected.is_equivalent_to(sharding, ndim)


def device_ids(sharding: Any) -> list:
    """The devices of a sharding, by id: in mesh order for a `NamedSharding`
    (the order that decides which device holds which shard), else sorted."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, Mesh):
        return [d.id for d in mesh.devices.flat]
    return sorted(d.id for d in sharding.device_set)


def same_mesh_shape(a: Any, b: Any) -> bool:
    """Whether two meshes have the same axis names and sizes (devices aside)."""
    return (tuple(a.axis_names), tuple(a.axis_sizes)) == (
        tuple(b.axis_names),
        tuple(b.axis_sizes),
    )


def agrees(sharding: Any, target: Any, ndim: int) -> bool:
    """Whether `sharding` lays an array of rank `ndim` out as the concrete `target`
    does: `is_equivalent_to` (spec, devices, memory kind). A `NamedSharding` on an
    abstract mesh (a `jax.ShapeDtypeStruct`'s, or a target derived on one by
    `jts.preflight`) has no devices: it agrees when its mesh has the target's
    axes and sizes and its spec the target's layout."""
    mesh = getattr(sharding, "mesh", None)
    target_mesh = getattr(target, "mesh", None)
    abstract = not isinstance(mesh, Mesh) or isinstance(target_mesh, AbstractMesh)
    if isinstance(sharding, NamedSharding) and target_mesh is not None:
        # `is_equivalent_to` compares unreduced axes but not reduced ones.
        sizes = _mesh.sizes(mesh)
        for read in (_spec.unreduced_axes, _spec.reduced_axes):
            if {a for a in read(sharding.spec) if sizes.get(a, 1) != 1} != {
                a for a in read(target.spec) if sizes.get(a, 1) != 1
            }:
                return False
    if isinstance(sharding, NamedSharding) and abstract:
        if target_mesh is None or not same_mesh_shape(mesh, target_mesh):
            return False
        sizes = _mesh.sizes(mesh)
        return _spec.normalise(
            _spec.entries_of(sharding.spec), ndim, sizes
        ) == _spec.normalise(_spec.entries_of(target.spec), ndim, sizes)
    return target.is_equivalent_to(sharding, ndim)


def contrast(
    sharding: Any, target: Any, dtype: Any, shape: Any, expected: _spec.Entries
) -> tuple[str, str, str]:
    """An array's layout and the expected one, in JAX's notation
    (`` `float32[8@data,4]` ``); where the notation is the same on both sides,
    what differs: the array's mesh, device order or memory kind (with the first),
    and the expected device order or memory kind (the third)."""
    spec = getattr(sharding, "spec", None)
    entries = _spec.entries_of(spec) if spec is not None else ()
    actual = _spec.format_array(dtype, shape, entries, spec)
    wanted = _spec.format_array(dtype, shape, expected, getattr(target, "spec", None))
    here = there = ""
    if spec is None:
        here = f" ({sharding})"
    elif actual == wanted:
        mesh, target_mesh = sharding.mesh, getattr(target, "mesh", None)
        if target_mesh is not None and not same_mesh_shape(mesh, target_mesh):
            here = f" on the mesh {_mesh.format_mesh(mesh)}"
        if isinstance(mesh, Mesh) and device_ids(sharding) != device_ids(target):
            here += f" over devices {device_ids(sharding)}"
            there = f" over devices {device_ids(target)}"
        elif not here:
            here = f" in memory {sharding.memory_kind!r}"
            there = f" in memory {target.memory_kind!r}"
    return f"`{actual}`{here}", f"`{wanted}`", there


# Axis types (issue 33, item 3). `is_equivalent_to` ignores them, but JAX does
# not: under `jax.set_mesh(mesh)` every primitive requires each operand's mesh to
# equal the context mesh, axis types included, unless both are all Auto
# (`jax._src.core.check_avals_context_mesh`). An array restored on a mesh of the
# same devices with other axis types passes every layout check, and the first
# `jit` under that mesh raises.


def _all_auto(mesh: Any) -> bool:
    return all(t == AxisType.Auto for t in mesh.axis_types)


def _types_differ(mesh: Any, other: Any) -> bool:
    return same_mesh_shape(mesh, other) and tuple(mesh.axis_types) != tuple(
        other.axis_types
    )


def context_types_clash(mesh: Any, context: Any) -> bool:
    """Whether a value on `mesh` breaks JAX under the context mesh `context` by
    its axis types alone (the same axis names and sizes, other types; both all
    Auto is JAX's one exception)."""
    if context is None or context.empty or mesh is None or mesh.empty:
        return False
    return not (_all_auto(mesh) and _all_auto(context)) and _types_differ(mesh, context)


def target_types_clash(mesh: Any, target_mesh: Any) -> bool:
    """Whether a value on `mesh` fails a concrete sharding's mesh by its axis
    types: the target has an Explicit (or Manual) axis, so its types are part of
    the layout asked for, and `mesh`'s differ. An all-Auto target asks nothing of
    them (XLA decides there)."""
    if target_mesh is None or mesh is None or _all_auto(target_mesh):
        return False
    return _types_differ(mesh, target_mesh)


def _types(mesh: Any) -> str:
    return "(" + ", ".join(t.name for t in mesh.axis_types) + ")"


def types_message(
    what: str, mesh: Any, other: Any, whose: str, laid_out: bool = True
) -> str:
    """Why `what` (`this array`) on `mesh` fails for its axis types, against
    `whose` (`the context mesh`) `other`, and the fix; `laid_out`: its layout is
    known to match."""
    axes = ", ".join(repr(n) for n in mesh.axis_names)
    return (
        f"{what} is on a mesh with axis types {_types(mesh)}, not "
        f"{_types(other)} as {whose} has (axes {axes})"
        + ("; its layout matches, but" if laid_out else ":")
        + " the first `jit` under `jax.set_mesh` of that mesh raises (JAX "
        "compares axis types, `is_equivalent_to` does not). Reshard it onto that "
        "mesh: restore onto (or `jax.device_put` onto) the shardings of "
        "`jts.abstract(..., mesh=mesh)`; one array: `jax.device_put(x, "
        "NamedSharding(mesh, x.sharding.spec))`."
    )
