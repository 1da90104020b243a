"""From an annotation to a `PartitionSpec` and a `NamedSharding`: one path.

Everything that turns an annotation into a spec (`spec_of`, `sharding_of`,
`shardings`, `check_tree` for spec leaves, `typed_shard_map`) goes through
`given.layout_of` (which layout does this annotation ask for?) and `spec_for`
(that layout for a given shape or rank, logical names resolved by `resolve` with
the rules in force).
"""

from typing import Any, Optional, Union

from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._rules.scope import current as _current_rules
from . import resolve as _resolve, spec as _spec
from .given import describe, fixed_rank, layout_of, stack_hint
from .spec import Lead, LogicalLayout


# For a `PartitionSpec` naming an axis the mesh lacks: Flax's logical spec tree.
LOGICAL_SPECS_HINT = (
    " If its names are logical (Flax Linen's `nn.get_partition_spec`), mark the "
    "tree as such: `jts.logical_specs(specs)`."
)


def spec_for(
    annotation: Any,
    shape: Union[tuple, int, None],
    mesh: Any,
    where: str = "",
    lead: tuple = (),
) -> PartitionSpec:
    """The annotation's spec for one array, one entry per dim: THE path from an
    annotation to a spec, every caller's (checks resolve through the same
    `resolve.resolve`, with the inputs `_verdict.inputs.of_value` reads off a value).

    - `shape`: the array's global shape when it is known (a tuple: a logical
        annotation's fallback lists skip candidates that do not divide a dim);
        its rank when only that is (an int: inside `shard_map`, where only local
        shapes are; `spec_of`); `None`: the rank the dim string fixes (or, when
        nothing is sharded after a variadic dim, the leading dims only).
    - `mesh`: the mesh the array is (or will be) on, its axes and sizes checked
        against the rules in force; `None` when not known.
    - `lead`: for the layer of a stacked leaf, the stack's entries before the
        dims `shape` counts: the mesh axes they hold are taken (`resolve`).
    """
    if isinstance(annotation, Lead):
        return _lead_spec(annotation, shape, mesh, where)
    if isinstance(annotation, NamedSharding):
        annotation = annotation.spec
    layout = layout_of(annotation, where)
    fixed = None if isinstance(annotation, PartitionSpec) else fixed_rank(annotation)
    prefix = f"{where}: " if where else ""
    ndim = len(shape) if isinstance(shape, tuple) else shape
    if ndim is not None:
        if not isinstance(ndim, int) or ndim < 0:
            raise ValueError(f"{prefix}ndim must be a non-negative int, not {ndim!r}.")
        if fixed is not None and ndim != fixed:
            raise ShardingAnnotationError(
                f"{prefix}{describe(annotation)} has {fixed} dims, but ndim={ndim}."
                + (stack_hint(ndim - fixed) if ndim > fixed else "")
            )
        if ndim < layout.min_rank:
            raise ShardingAnnotationError(
                f"{prefix}{describe(annotation)} shards {layout.min_rank} dims, more "
                f"than ndim={ndim}."
            )
    elif fixed is not None:
        ndim = fixed
    elif any(layout.suffix):
        raise ShardingAnnotationError(
            f"{prefix}{describe(annotation)} shards dims after a variadic dim, so "
            "its spec depends on the array's rank: pass `ndim=`."
        )
    if ndim is None:
        ndim = layout.min_rank
        pad_to = len(layout.entries(ndim)) if isinstance(layout, _spec.Layout) else 0
    else:
        pad_to = ndim
    known = shape if isinstance(shape, tuple) else ndim
    label = f"{where}: {describe(annotation)}" if where else describe(annotation)
    rules = _current_rules()
    entries = _resolve.resolve(layout, known, mesh, rules, label, lead)
    entries = entries + ((),) * (pad_to - len(entries))
    unreduced, reduced = _resolve.pending(layout, mesh, rules, label)
    return _spec.make_spec(entries, unreduced, reduced)


def _lead_spec(
    annotation: Lead, shape: Union[tuple, int, None], mesh: Any, where: str
) -> PartitionSpec:
    """A stacked leaf's spec: its declared leading entries, then its layer's
    annotation for the dims after them (replicated if that names no sharding)."""
    n, inner = len(annotation.lead), annotation.inner
    ndim = len(shape) if isinstance(shape, tuple) else shape
    prefix = f"{where}: " if where else ""
    if ndim is not None and ndim < n:
        raise ShardingAnnotationError(
            f"{prefix}rank {ndim}: fewer dims than its {n} declared stacked "
            "(`stacked=` or `jts.Stacked[...]`). Declare the stack it has."
        )
    rest = shape[n:] if isinstance(shape, tuple) else None if ndim is None else ndim - n
    if not _spec.has_sharding(inner):
        count = rest if isinstance(rest, int) else len(rest or ())
        return PartitionSpec(*annotation.lead, *([None] * count))
    try:
        spec = spec_for(inner, rest, mesh, where, annotation.lead)
    except ShardingAnnotationError as error:
        raise ShardingAnnotationError(
            f"{error} (after the leaf's {n} declared stacked dim{'s' * (n > 1)}: "
            "check `stacked=` or its `jts.Stacked[...]` field)"
        ) from None
    return spec.update(partitions=(*annotation.lead, *_spec.partitions_of(spec)))


def needs_shape(annotation: Any) -> bool:
    """Whether the annotation's spec may depend on the array's sizes under the
    rules in force (a logical annotation and a fallback list, or
    `conflicts="fallback"`): where not, a spec by rank is the spec."""
    try:
        layout = layout_of(annotation)
    except ShardingAnnotationError:
        return False
    return _resolve.depends_on_shape(layout, _current_rules())


def spec_of(annotation: Any, ndim: Optional[int] = None) -> PartitionSpec:
    """The `PartitionSpec` an annotation asks for.

    !!! Example

        ```python
        import jaxtyping_shard as jts
        from jax.sharding import PartitionSpec as P
        from jaxtyping import Array
        from jaxtyping_shard import Float

        assert jts.spec_of(Float[Array, "batch@data embed"]) == P("data", None)
        assert jts.spec_of(Float[Array, "*lead seq@model"], ndim=3) == P(
            None, None, "model"
        )
        ```

    **Arguments:**

    - `annotation`: a sharded annotation (`Float[Array, "b e", P("data", None)]`
        or `Float[Array, "b@data e"]`), a `PartitionSpec`, or a `NamedSharding`.
    - `ndim`: the array's rank. Needed only when the dim string shards dims after
        a variadic dim (`"*lead seq@model"`).

    **Returns:**

    A `PartitionSpec` with one entry per dim when the rank is known (from the dim
    string or `ndim`), else one per leading dim the annotation describes.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] when the annotation has no
    sharding, when `ndim` is needed and missing, or when `ndim` contradicts the
    dim string.
    """
    return spec_for(annotation, ndim, None, "spec_of")


def sharding_of(
    annotation: Any, mesh: Any = None, ndim: Optional[int] = None
) -> NamedSharding:
    """The `NamedSharding` an annotation asks for, on a mesh.

    !!! Example

        ```python
        import jax
        import jaxtyping_shard as jts
        from jax.sharding import AxisType
        from jaxtyping import Array
        from jaxtyping_shard import Float

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        sharding = jts.sharding_of(Float[Array, "batch@data embed"], mesh)
        x = jax.device_put(jax.numpy.zeros((8, 4)), sharding)
        ```

    **Arguments:**

    - `annotation`: as for [`jaxtyping_shard.spec_of`][]. A `NamedSharding` is
        returned as it is when `mesh` is omitted or is its mesh.
    - `mesh`: a `jax.sharding.Mesh`. Omitted: the context mesh (`jax.set_mesh`),
        which must then be a concrete mesh.
    - `ndim`: as for [`jaxtyping_shard.spec_of`][].

    **Returns:**

    A `jax.sharding.NamedSharding`.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] as `spec_of` does, and when the
    mesh lacks an axis the annotation names; `ValueError` when no mesh is given
    or set.
    """
    if isinstance(annotation, NamedSharding) and (
        mesh is None or mesh is annotation.mesh
    ):
        return annotation
    if isinstance(layout_of(annotation, "sharding_of"), LogicalLayout):
        mesh = resolve_mesh(mesh, "sharding_of")  # the rules are checked against it
    spec = spec_for(annotation, ndim, mesh, "sharding_of")
    return named_sharding(spec, mesh, annotation)


def resolve_mesh(mesh: Any, what: str) -> Any:
    """`mesh`, else the context mesh (concrete outside `jit`, abstract inside)."""
    if mesh is not None:
        return mesh
    concrete = _mesh.set_concrete_mesh()
    if concrete is not None:
        return concrete
    context = _mesh.context_mesh()
    if context is not None:
        return context
    raise ValueError(
        f"{what} needs a mesh: pass `mesh=`, or call it under `jax.set_mesh(mesh)`."
    )


def named_sharding(
    spec: PartitionSpec, mesh: Any, annotation: Any, where: str = "sharding_of"
) -> NamedSharding:
    """`NamedSharding(mesh, spec)`, with an error naming a missing mesh axis."""
    mesh = resolve_mesh(mesh, where)
    names = set(mesh.axis_names)
    pending = _spec.unreduced_axes(spec) | _spec.reduced_axes(spec)
    for entry in (*_spec.partitions_of(spec), tuple(sorted(pending))):
        for axis in (
            () if entry is None else (entry,) if isinstance(entry, str) else entry
        ):
            if axis not in names:
                axes = ", ".join(repr(a) for a in mesh.axis_names) or "none"
                raise ShardingAnnotationError(
                    f"{where}: {describe(annotation)} names mesh axis {axis!r}, but "
                    "the mesh "
                    f"{_mesh.format_mesh(mesh)} has axes {axes}. Fix the axis name "
                    "in the annotation, or pass the mesh you meant."
                    + LOGICAL_SPECS_HINT
                    * isinstance(annotation, PartitionSpec)
                )
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    if pending - set(explicit):
        raise ShardingAnnotationError(
            f"{where}: {describe(annotation)} asks for a value unreduced or reduced "
            f"over {', '.join(repr(a) for a in sorted(pending - set(explicit)))}, "
            f"not `Explicit` axes of the mesh {_mesh.format_mesh(mesh)}: JAX has "
            "unreduced and reduced values only on `Explicit` axes. Make those axes "
            "`Explicit`, or annotate without `unreduced` / `reduced`."
        )
    return NamedSharding(mesh, spec)
