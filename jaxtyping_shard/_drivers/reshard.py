"""`reshard` and `out_sharding`: the annotation lays a value out, on any mesh.

JAX offers three ways to move a value to a layout, each refusing the others'
meshes: `jax.sharding.reshard` takes only `Explicit` axes,
`jax.lax.with_sharding_constraint` only asserts on an all-`Explicit` mesh, and an
op's `out_sharding=` refuses `Auto` axes. A program meant to run on both kinds of
mesh would branch on the axis types at each such point; these two functions do
it once, from an annotation resolved by the one path of `_bridge` (logical names
through the rules in force).
"""

from collections.abc import Callable, Mapping
from typing import Any, Optional

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._annotation.used import used_annotation
from .._core import compat, mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._layout import bridge as _bridge, given as _given
from .._layout.spec import (
    has_sharding,
    Lead,
    LogicalLayout,
    only_axes,
    pending_of,
    reduced_axes,
)
from .._trees import hints as _hints, walk as _tree
from .._verdict.compare import same_mesh_shape


def reshard(
    x: Any, annotation: Any = None, *, stacked: Optional[Mapping[str, Any]] = None
) -> Any:
    """`x` laid out as its annotation says, on an `Explicit`, `Auto` or mixed mesh.

    The one call for the places where a program *means* to change a layout (the
    all-gather of an FSDP weight before its matmul, the layout of a row-parallel
    result), written with the annotation instead of a `PartitionSpec`:

    | where `x` is | what is done |
    | --- | --- |
    | traced, `Explicit` mesh axes | `jax.sharding.reshard` (the type changes) |
    | traced, `Auto` axes | `jax.lax.with_sharding_constraint` |
    | traced, a mixed mesh | `reshard` (`Explicit` axes), then the constraint |
    | a concrete array | `jax.device_put` |

    It moves data on purpose, so it is no check: a wrong value is moved, not
    reported. Check values where they are consumed (annotated parameters). On
    `Auto` axes a check of a value `reshard` returned is decided at trace time,
    as on `Explicit` axes (XLA keeps the constraint): the error names that value,
    before the values XLA would propagate its layout to.

    Its gradient is laid out as its input was: on `Explicit` axes JAX reshards
    the cotangent back; on `Auto` axes it is constrained to the same layout as
    the value. So `params = jts.reshard(params)` at the top of a loss function
    (a no-op going forward) makes the gradients come back laid out as the
    parameters, on either kind of mesh.

    !!! Example

        ```python
        W = Float[Array, "embed mlp", jts.Logical]
        Gathered = Float[Array, "embed mlp", jts.Logical("act_embed", "mlp")]

        def mlp(x, w):  # w stored sharded over FSDP, gathered for the matmul
            return x @ jts.reshard(w, Gathered)
        ```

    **Arguments:**

    - `x`: an array, or a pytree of arrays.
    - `annotation`: a sharded annotation (logical names resolve through the rules
        in force), a `PartitionSpec` or a `NamedSharding` (a concrete array is
        placed on its devices, in its memory kind; a traced value, whose
        devices `jit` fixes, is laid out by its spec): for every leaf. Or,
        for a tree, what [`jaxtyping_shard.shardings`][] takes as `annotations=`
        (a type hint, an annotation tree); omitted, the annotations of the
        tree's own fields. Leaves without a sharded annotation are left as
        they are.
    - `stacked`: as for [`jaxtyping_shard.sharded_init`][]: `{pattern: n}` gives
        the matching leaves `n` extra leading dims before their annotation's
        (a field annotated `jts.Stacked[Block]` needs no pattern).

    **Returns:**

    `x` with the annotated layout.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] when the annotation has no
    sharding or names an axis the mesh lacks, or the value is inside `shard_map`
    (`Manual` axes); `ValueError` when no mesh is known.
    """
    return _each_leaf(x, annotation, stacked, _reshard_leaf, "reshard")


def as_used(x: Any, annotation: Any = None) -> Any:
    """`x` laid out as used: [`jaxtyping_shard.reshard`][] to the "as used" form
    ([`jaxtyping_shard.Used`][]) of each leaf's annotation.

    The one call that gathers a module's FSDP-sharded weights for its
    computation: each logical name whose rule is [`jaxtyping_shard.fsdp`][] is
    gathered, every other stays as annotated (tensor parallelism).

    !!! Example

        ```python
        class Mlp(eqx.Module):
            w_in: Float[Array, "embed mlp", jts.Logical]
            w_out: Float[Array, "mlp embed", jts.Logical]

            def __call__(self, x):
                mlp = jts.as_used(self)  # the all-gathers of FSDP, nothing else
                return jts.einsum("bsm,me->bse", x @ mlp.w_in, mlp.w_out)
        ```

    **Arguments:**

    - `x`: an array or a pytree (an Equinox module, a dataclass, ...).
    - `annotation`: as for [`jaxtyping_shard.reshard`][]; omitted, the
        annotations of the tree's own fields. A leaf whose annotation is
        physical (`P(...)`, `@`) is laid out as written: it names its axes
        itself, and no rule says which of them FSDP holds.

    **Returns:** `x`, every annotated leaf laid out as used; others unchanged.
    Its gradient comes back laid out as stored, on `Explicit` and `Auto` axes
    alike (inside a trace each leaf is first constrained to its stored layout,
    a no-op going forward).

    **Raises:** as [`jaxtyping_shard.reshard`][].
    """
    return _each_leaf(x, annotation, None, _as_used_leaf, "as_used")


def _each_leaf(
    x: Any,
    annotation: Any,
    stacked: Optional[Mapping[str, Any]],
    lay_out: Callable[[Any, Any], Any],
    caller: str,
) -> Any:
    """`lay_out(leaf, its annotation)` on every annotated leaf of `x`: one
    annotation for every leaf, or each leaf's own from the tree's walk."""
    if (annotation is not None and not stacked) and (
        isinstance(annotation, (PartitionSpec, NamedSharding))
        or _hints.leaf_annotation(annotation) is not None
    ):
        return jax.tree.map(lambda leaf: lay_out(leaf, annotation), x)
    leaves, plan = _tree.plan_for(x, annotation, stacked=stacked)
    _tree.refuse_problems(leaves, plan, caller, "x")
    out = []
    for leaf, a, path in zip(leaves, plan.annotations, plan.paths):
        if not has_sharding(a):
            out.append(leaf)
            continue
        try:
            out.append(lay_out(leaf, a))
        except ShardingAnnotationError as error:
            # The leaf first: its annotation alone does not say which it is.
            text = str(error).removeprefix(f"{caller}: ")
            name = "x" + jax.tree_util.keystr(path)
            raise ShardingAnnotationError(f"{caller}: {name}: {text}") from None
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def _as_used_leaf(leaf: Any, annotation: Any) -> Any:
    if isinstance(leaf, Tracer):
        kept = _keep_reduced(leaf, _used(annotation))
        if kept is not None:
            return kept
        # First as stored (a no-op going forward): on `Auto` axes the gradient
        # is then constrained to the stored layout, as on `Explicit` ones,
        # instead of coming back gathered.
        leaf = _reshard_leaf(leaf, annotation)
    return _reshard_leaf(leaf, _used(annotation))


def _keep_reduced(leaf: Any, used: Any) -> Any:
    """A traced leaf `reduced` over axes its layout as used shards no dim over
    (gradient accumulation: the parameters gathered once, marked `reduced`):
    laid out as used, still `reduced` (its cotangent stays unreduced, summed
    once by the caller). None for every other leaf (the ordinary path)."""
    aval = jax.typeof(leaf)
    reduced = reduced_axes(getattr(aval.sharding, "spec", None))
    mesh = _mesh.of_aval(aval)
    if not reduced or mesh is None or isinstance(used, NamedSharding):
        return None
    spec = _bridge.spec_for(used, tuple(aval.shape), mesh, "as_used")
    if any(pending_of(spec)) or reduced & {
        a for e in spec for a in ((e,) if isinstance(e, str) else e or ())
    }:
        return None  # its layout declares its own, or shards over them
    return jax.sharding.reshard(leaf, PartitionSpec(*spec, reduced=reduced))


def _used(annotation: Any) -> Any:
    if isinstance(annotation, (PartitionSpec, NamedSharding)):
        return annotation
    if isinstance(annotation, Lead):  # a stacked leaf: its layer's, as used
        return Lead(_used(annotation.inner), annotation.lead)
    if not has_sharding(annotation):
        return annotation  # a stacked leaf's unannotated layer: as stacked
    if isinstance(_given.layout_of(annotation, "as_used"), LogicalLayout):
        return used_annotation(annotation, "as_used")
    return annotation  # physical: as written


def out_sharding(
    annotation: Any, ndim: Optional[int] = None, *, shape: Optional[tuple] = None
) -> Any:
    """What an op's `out_sharding=` should get for a result annotated so.

    On `Explicit` mesh axes JAX's ops need `out_sharding=` where a layout is
    ambiguous (a matmul contracting a sharded dim, a gather from a sharded
    index); on `Auto` axes they refuse it. This returns the annotation's
    `PartitionSpec` on a mesh with `Explicit` axes (on a mixed mesh, with its
    `Auto` axes left out), and `None` on an all-`Auto` mesh (XLA chooses: follow
    with [`jaxtyping_shard.reshard`][] to constrain it). Call it under the mesh
    (`jax.set_mesh`), as the op itself is.

    !!! Example

        ```python
        y = jnp.einsum("bsm,me->bse", h, w_out, out_sharding=jts.out_sharding(Hidden))
        ```

    **Arguments:**

    - `annotation`: as for [`jaxtyping_shard.reshard`][].
    - `ndim`: the result's rank, when the dim string does not fix it.
    - `shape`: the result's global shape. Given, a logical annotation is
        resolved for it (a fallback list skips a candidate that does not divide
        a dim), as the check of the result will be; omitted, by rank only.

    **Returns:**

    A `PartitionSpec`, or `None`.
    """
    mesh = _mesh.context_mesh()
    if mesh is None:
        return None
    if shape is not None and ndim is not None and len(shape) != ndim:
        raise ValueError(
            f"out_sharding: shape {tuple(shape)} has {len(shape)} dims, not "
            f"ndim={ndim}."
        )
    known = ndim if shape is None else tuple(shape)
    spec = _bridge.spec_for(annotation, known, mesh, "out_sharding")
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    if not explicit:
        return None
    return only_axes(spec, explicit)


def _reshard_leaf(x: Any, annotation: Any) -> Any:
    if not isinstance(x, Tracer):
        if isinstance(annotation, NamedSharding):
            # Its own devices and memory kind, not only its spec.
            _bridge.spec_for(annotation, tuple(x.shape), annotation.mesh, "reshard")
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
            if kind is not None and kind != annotation.memory_kind:
                # One device_put changes the devices or the memory, not both (JAX
                # 0.10 on CPU): the devices first, in the memory the value is in.
                mesh, spec = annotation.mesh, annotation.spec
                x = jax.device_put(x, NamedSharding(mesh, spec, memory_kind=kind))
            return jax.device_put(x, annotation)
        mesh = _value_mesh(x)
        spec = _bridge.spec_for(annotation, tuple(x.shape), mesh, "reshard")
        return jax.device_put(x, _bridge.named_sharding(spec, mesh, annotation))
    aval = jax.typeof(x)
    mesh = _mesh.of_aval(aval)
    if mesh is None and isinstance(annotation, NamedSharding):
        # No mesh in the value's type or the context: the sharding's own.
        with compat.mesh_scope(annotation.mesh.abstract_mesh):
            return _reshard_leaf(x, annotation)
    if mesh is None:
        raise ValueError(
            "reshard needs a mesh inside a trace: call it under `jax.set_mesh(mesh)`."
        )
    if isinstance(annotation, NamedSharding) and not same_mesh_shape(
        mesh, annotation.mesh
    ):
        raise ShardingAnnotationError(
            f"reshard: {_given.describe(annotation)} is on another mesh than the "
            f"traced value ({_mesh.format_mesh(mesh)}); inside a trace a value is "
            "laid out on the trace's mesh, whose devices `jit` fixes. Give the "
            "spec, or a NamedSharding on that mesh."
        )
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    if manual:
        raise ShardingAnnotationError(
            f"reshard: the value is inside `shard_map` (manual axes "
            f"{sorted(manual)}), where each device holds its own piece; lay values "
            "out outside the `shard_map` body."
        )
    spec = _bridge.spec_for(annotation, tuple(aval.shape), mesh, "reshard")
    _bridge.named_sharding(spec, mesh, annotation, "reshard")  # a missing axis
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    auto = _mesh.names_of_type(mesh, AxisType.Auto)
    if explicit:
        x = jax.sharding.reshard(x, only_axes(spec, explicit))
    if auto:
        constrained = only_axes(spec, auto) if explicit else spec
        x = jax.lax.with_sharding_constraint(x, constrained)
    return x


def _value_mesh(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding.mesh
    return _bridge.resolve_mesh(None, "reshard")
