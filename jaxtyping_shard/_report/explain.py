"""`explain`: what the annotations (and the rules in force) mean on a mesh.

A table with one row per annotated leaf: its path, dims, logical names, mesh
axes, the shard each device holds, and the bytes that costs, computed from the
annotations alone (nothing is placed, nothing is compiled).
"""

import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._layout import bridge as _bridge, given as _given, spec as _spec
from .._layout.spec import (
    has_sharding,
    is_variadic,
    Lead,
    LogicalLayout,
    sharded_members,
)
from .._rules import scope as _rules
from .._trees import like as _like, paths as _paths, walk as _tree
from .._trees.stacked import stacked_prefixes
from .sizes import shard_bytes
from .text import format_bytes


class Row(NamedTuple):
    """One annotated array: what `explain` computed for it."""

    path: str
    dims: str  # the dim string ("embed mlp"), or the spec for a bare spec
    logical: Optional[tuple]  # logical name per dim (None: not sharded), or None
    spec: Optional[PartitionSpec]  # None: the leaf has no sharding annotation
    shape: Optional[tuple]  # global shape, if known
    dtype: Any
    shard_shape: Optional[tuple]  # per device, if the shape and mesh are known
    bytes_per_device: Optional[int]
    bytes_replicated: Optional[int]  # bytes stored beyond one copy, mesh-wide


class Explanation:
    """What [`jaxtyping_shard.explain`][] returns: rows, and a table when printed."""

    def __init__(self, rows: list, mesh: Any, rules: Any):
        self.rows: tuple[Row, ...] = tuple(rows)
        self.mesh = mesh
        self.rules = rules

    @property
    def bytes_per_device(self) -> Optional[int]:
        """The sum over rows, or `None` if some row's size is unknown."""
        return _sum(r.bytes_per_device for r in self.rows if r.spec is not None)

    @property
    def bytes_replicated(self) -> Optional[int]:
        return _sum(r.bytes_replicated for r in self.rows if r.spec is not None)

    def __str__(self) -> str:
        head = f"mesh {_mesh.format_mesh(self.mesh)}"
        if self.rules is not None:
            head += f"; axis rules {self.rules.describe()}"
        table = [
            ("path", "dims", "logical", "mesh axes", "shard/device", "bytes/device")
            + ("bytes replicated",)
        ]
        for row in self.rows:
            table.append(_cells(row))
        table.append(
            ("total", "", "", "", "")
            + (format_bytes(self.bytes_per_device), format_bytes(self.bytes_replicated))
        )
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = [head]
        for i, cells in enumerate(table):
            line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
            lines.append(line)
            if i == 0 or i == len(table) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


Explanation.__module__ = "jaxtyping_shard"


def _sum(values: Any) -> Optional[int]:
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def _cells(row: Row) -> tuple:
    logical = (
        "-"
        if row.logical is None
        else " ".join(n if n is not None else "_" for n in row.logical)
    )
    if row.spec is None:
        axes = "not annotated"
    elif row.shape is not None:
        entries = _spec.entries_of(row.spec)
        axes = _spec.format_array(row.dtype or "?", row.shape, entries, row.spec)
    else:
        axes = _spec.format_spec(row.spec)
    shard = "?" if row.shard_shape is None else "x".join(map(str, row.shard_shape))
    if row.spec is None:
        shard, per, rep = "-", "-", "-"
    else:
        per, rep = (
            format_bytes(row.bytes_per_device),
            format_bytes(row.bytes_replicated),
        )
    return (row.path, row.dims, logical, axes, shard or "()", per, rep)


_DIM_NAME = re.compile(r"[#_?]*([A-Za-z_][A-Za-z0-9_]*)\Z")


def _shape_from_sizes(dim_str: str, sizes: Optional[Mapping[str, int]]) -> Any:
    """The shape a dim string has with named sizes, or None if some are unknown."""
    shape = []
    for dim in dim_str.split():
        if is_variadic(dim):
            return None
        if dim.isdigit():
            shape.append(int(dim))
            continue
        match = _DIM_NAME.match(dim)
        if match is None or sizes is None or match.group(1) not in sizes:
            return None
        shape.append(int(sizes[match.group(1)]))
    return tuple(shape)


def _row(
    path: str,
    annotation: Any,
    value: Any,
    mesh: Any,
    sizes: Any,
    where: str,
    lead: tuple = (),
    key_path: tuple = (),
) -> Row:
    """One row; `lead`: the spec entries of the leaf's declared stacked dims."""
    members = sharded_members(annotation)
    member = members[0] if members else None
    layout = _given.layout_of(annotation, where)
    if member is not None:
        dims = member.dim_str
        fixed = len(member.dims) if member.index_variadic is None else None
    else:
        dims = _spec.format_spec(_bridge.spec_for(annotation, None, None, where))
        fixed = None
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    inner: Optional[tuple] = None  # the dims the annotation describes
    if shape is not None:
        shape = tuple(shape)
        inner = _inner_shape(shape, lead, fixed, annotation, where, key_path)
    elif member is not None:
        inner = _shape_from_sizes(dims, sizes)
        shape = None if lead else inner  # a stack's own sizes are not known
        if member.dtypes and len(member.dtypes) == 1:
            dtype = np.dtype(member.dtypes[0])
    ndim = len(inner) if inner is not None else fixed
    if ndim is None:
        ndim = layout.min_rank
    resolved = _bridge.spec_for(annotation, inner or ndim, mesh, where, lead)
    entries = _spec.entries_of(resolved)
    entries = tuple(_entry(e) for e in lead) + entries + ((),) * (ndim - len(entries))
    _check_axes(entries, mesh, annotation, where)
    spec = _spec.make_spec(entries, *_spec.pending_of(resolved))
    logical = None
    if isinstance(layout, LogicalLayout):
        logical = (None,) * len(lead) + tuple(layout.names(ndim))
    dims = " ".join(["[stack]"] * len(lead) + [dims])
    pending = _spec.unreduced_axes(spec)
    shard, per_device, replicated = shard_bytes(shape, dtype, entries, mesh, pending)
    return Row(path, dims, logical, spec, shape, dtype, shard, per_device, replicated)


def _entry(value: Any) -> tuple:
    """A `stacked=` spec entry (`None`, `'pipe'`, `('x', 'y')`) as a tuple of axes."""
    return () if value is None else (value,) if isinstance(value, str) else value


def _inner_shape(
    shape: tuple,
    lead: tuple,
    fixed: Optional[int],
    annotation: Any,
    where: str,
    key_path: tuple,
) -> tuple:
    """The dims after the declared stacked ones; their count must be the
    annotation's (a stack that is not declared is an error, never guessed)."""
    if len(lead) > len(shape):
        raise ShardingAnnotationError(
            f"{where}: rank {len(shape)}, fewer dims than its {len(lead)} stacked."
        )
    inner = shape[len(lead) :]
    if fixed is None or len(inner) == fixed:
        return inner
    after = f" after its {len(lead)} stacked" if lead else ""
    hint = ""
    if len(inner) > fixed:
        hint = _given.stack_hint(len(shape) - fixed, _paths.rule_path(key_path))
    raise ShardingAnnotationError(
        f"{where}: {_given.describe(annotation)} has {fixed} dims, but the array of "
        f"shape {shape} has {len(inner)}{after}.{hint}"
    )


def _check_axes(entries: tuple, mesh: Any, annotation: Any, where: str) -> None:
    if mesh is None:
        return
    names = set(mesh.axis_names)
    for axis in (a for entry in entries for a in entry):
        if axis not in names:
            axes = ", ".join(repr(a) for a in mesh.axis_names)
            raise ShardingAnnotationError(
                f"{where}: {_given.describe(annotation)} names mesh axis {axis!r}, "
                f"which the mesh {_mesh.format_mesh(mesh)} lacks (axes {axes}). Fix "
                "the axis name, or pass the mesh you meant."
            )


@_rules.per_call  # axis_rules=: the call runs under that table
def explain(
    annotation_or_tree: Any,
    mesh: Any = None,
    *,
    annotations: Any = None,
    rules: Optional[Mapping[str, Any]] = None,
    sizes: Optional[Mapping[str, int]] = None,
    stacked: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    axis_rules: Any = None,
) -> Explanation:
    """A table of what annotations mean on a mesh, under the axis rules in force.

    One row per annotated array: its path, dims, logical names, mesh axes (in
    JAX's notation, `float32[8@fsdp,4]`), the shard each device holds, the bytes
    per device, and the bytes replicated: what the mesh stores beyond one copy
    of the array (0 for a fully sharded array, 7 copies' worth for a replicated
    one on 8 devices). A total row sums them. Nothing is placed or compiled.

    !!! Example

        ```python
        import jax
        from jax.sharding import AxisType
        from jaxtyping import Array
        import jaxtyping_shard as jts
        from jaxtyping_shard import Float

        mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"),
                             axis_types=(AxisType.Explicit,) * 2)
        params = {"w_in": jax.ShapeDtypeStruct((1024, 4096), "float32")}
        with jts.axis_rules({"embed": "fsdp", "mlp": "tensor"}):
            print(jts.explain(params, mesh, annotations={
                "w_in": Float[Array, "embed mlp", jts.Logical]}))
        ```

    **Arguments:**

    - `annotation_or_tree`: one annotation (`Float[Array, "embed mlp",
        Logical]`, a `PartitionSpec`), or a tree of arrays /
        `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`) whose annotations
        are found as [`jaxtyping_shard.shardings`][] finds them, or a tree whose
        leaves are annotations.
    - `mesh`: the mesh (a `jax.sharding.AbstractMesh` of any size will do);
        omitted, the context mesh (`jax.set_mesh`). Without any,
        shard shapes and bytes are `?`.
    - `annotations`, `rules`: as for [`jaxtyping_shard.shardings`][] (an
        annotation tree; path rules); `axis_rules`: the logical axis rules.
    - `sizes`: for annotations without values, the size of each dim name
        (`{"embed": 4096, "mlp": 16384}`), so that shards and bytes can be
        computed.
    - `stacked`: as for [`jaxtyping_shard.sharded_init`][]: `{pattern: n}`
        declares that the leaves matching the path pattern (`"blocks/**"`) have
        `n` extra leading dims before the ones their annotation describes
        (layers stacked with `eqx.filter_vmap`), replicated; `{pattern:
        ("pipe",)}` shards them. Their dims show as `[stack]`. A leaf with more
        dims than its annotation and no declared stack is an error, never
        guessed.
    - `like`: another tree (the parameters): each leaf of the tree is laid out
        by [`jaxtyping_shard.check_tree`][]'s `like=` rule (an optimiser state's
        moments as the parameters, its other leaves replicated), shown as the
        spec it gets. Not together with `annotations`, `rules` or `stacked`.

    **Returns:**

    An `Explanation`: printed, the table; `.rows` holds one `Row` per leaf
    (`path`, `dims`, `logical`, `spec`, `shape`, `dtype`, `shard_shape`,
    `bytes_per_device`, `bytes_replicated`); `.bytes_per_device` and
    `.bytes_replicated` are the totals.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] as a check would: a logical
    name with no rule, a conflict, a mesh axis the mesh lacks, an array whose
    rank its annotation (after any declared stack) contradicts; a `stacked=`
    pattern that matches no leaf.
    """
    if mesh is None:
        mesh = _mesh.context_mesh()
    rows = []
    if like is not None:
        if annotations is not None or rules is not None or stacked:
            raise ValueError(
                "explain: give `like` or annotations/rules/stacked, not both."
            )
        values, plan = _tree.plan_for(annotation_or_tree)
        like_plan, what = _tree.plan_for(like), "explain(like=...)"
        specs = _like.like_specs(annotation_or_tree, values, plan, like_plan, what)
        if mesh is None:
            mesh = _like.like_mesh(like)
        for value, key_path, spec in zip(values, plan.paths, specs):
            path = jax.tree_util.keystr(key_path) or "-"
            rows.append(_row(path, spec, value, mesh, sizes, f"tree{path}"))
    elif has_sharding(annotation_or_tree) and annotations is None:
        if stacked:
            raise ShardingAnnotationError(
                "explain: stacked= declares the stacked dims of a tree's leaves by "
                "path; give the tree (e.g. the result of sharded_init), not one "
                "annotation."
            )
        where = _given.describe(annotation_or_tree)
        rows.append(_row("-", annotation_or_tree, None, mesh, sizes, where))
    else:
        tree = annotation_or_tree
        values, plan = _tree.plan_for(tree, annotations, rules, stacked)
        _tree.refuse_problems(values, plan, "explain")
        declared = stacked_prefixes(plan.paths, stacked)
        for leaf, by_key in zip(
            _tree.walk(tree, annotations, rules, stacked), declared
        ):
            path = jax.tree_util.keystr(leaf.path) or "-"
            annotation, value, lead = leaf.annotation, leaf.value, ()
            if isinstance(annotation, Lead):  # a stacked leaf
                annotation, lead = annotation.inner, annotation.lead
            if annotation is None and has_sharding(value):
                annotation, value, lead = value, None, by_key  # annotations
            if isinstance(annotation, NamedSharding):
                annotation = annotation.spec
            if not has_sharding(annotation):
                rows.append(_unannotated(path, value))
                continue
            where = f"tree{path}" if path != "-" else "tree"
            rows.append(
                _row(path, annotation, value, mesh, sizes, where, lead, leaf.path)
            )
    return Explanation(rows, mesh, _rules.current())


def _unannotated(path: str, value: Any) -> Row:
    shape = getattr(value, "shape", None)
    dims = "-" if not shape else " ".join(map(str, shape))
    dtype = getattr(value, "dtype", None)
    return Row(path, dims, None, None, shape, dtype, None, None, None)
