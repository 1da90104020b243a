"""Resolution: the spec entries one array's annotation asks for, here and now.

`resolve(layout, shape or rank, mesh, rules)` is the one function from a layout
(physical or logical) to spec entries: a physical `Layout` gives its own; a
`LogicalLayout` is resolved through an axis rules table (dict or Linen pairs,
fallback lists, conflict policy), against the mesh's axes and sizes and, when
known, the array's shape. Cached per (layout, shape, mesh axes, rules).
"""

import functools
import math
from typing import Any, Optional, Union

from .._core.errors import ShardingAnnotationError
from .._rules.table import AxisRules, Candidate, format_candidate
from . import conflicts as _conflicts, follows as _follows, spec as _spec
from .spec import LogicalLayout


Shape = Union[tuple[int, ...], int]


def resolve(
    layout: Union[LogicalLayout, _spec.Layout],
    shape: Shape,
    mesh: Any,
    rules: Optional[AxisRules],
    where: str = "the type hint",
    lead: tuple = (),
) -> _spec.Entries:
    """The spec entries of one array under a rules table: THE resolution.

    **Arguments:**

    - `layout`: an annotation's `_jts` (a physical `Layout` or a `LogicalLayout`).
    - `shape`: the array's global shape; or its rank when the sizes are not known
        (inside `shard_map`, where only local shapes are; an output's spec):
        candidates are then chosen without the divisibility test.
    - `mesh`: the mesh (anything with `axis_names` / `axis_sizes`), or `None`:
        then the rules' mesh axes are not checked against a mesh.
    - `rules`: the rules to use (callers pass those in force,
        `_rules.scope.current()`); `None`: no rules, an error for a logical
        layout.
    - `where`: the annotation, for messages.
    - `lead`: a stacked leaf's declared leading entries (`stacked=`,
        `jts.Stacked`), which come before the dims `layout` describes: the
        mesh axes they hold are taken, as a dim of the same array holding them
        would take them. A logical name whose candidate the stack holds falls
        back (a `jts.fsdp` name is replicated: FSDP never splits the stacked
        dim, and never a second dim over the stack's axis); a physical layout
        naming one is refused.

    **Returns:** one entry per dim (a tuple of mesh axes, `()` for replicated).

    **Raises:** `ShardingAnnotationError`: no rules, a name with no rule, a mesh
    axis the mesh lacks, a conflict under `conflicts="error"`, a mesh axis both
    the stack and a physical layout name.
    """
    ndim = shape if isinstance(shape, int) else len(shape)
    if isinstance(layout, _follows.FollowsLayout):
        return resolve(_followed(layout, shape), shape, mesh, rules, where, lead)
    held = _conflicts.held_axes(lead)
    if isinstance(layout, _spec.Layout):
        entries = layout.entries(ndim)
        conflict = _conflicts.held_conflict(entries, held, lead, where) if held else ""
        if conflict:
            raise ShardingAnnotationError(conflict)
        return entries
    axes = None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
    return _resolve(layout, shape, axes, rules_for(layout, axes, rules), where, held)


def _followed(
    layout: "_follows.FollowsLayout", shape: Shape
) -> Union[LogicalLayout, _spec.Layout]:
    """What a leaf bound to a field's annotation (`jts.FollowsField`) asks for:
    the field's names or entries lined up with the leaf's dims (`follows.align`)."""
    ndim = shape if isinstance(shape, int) else len(shape)
    sizes = None if isinstance(shape, int) else tuple(shape)
    field, rank = layout.field, layout.rank(ndim)
    if isinstance(field, _spec.Layout):
        entries = field.entries(rank)
        entries = entries + ((),) * (rank - len(entries))
        return _spec.Layout(_follows.align(entries, ndim, sizes, ()), (), layout.text)
    names = _follows.align(field.names(rank), ndim, sizes, None)
    return LogicalLayout(names, (), False, layout.text, field.direct, field.used)


def pending(
    layout: Union[LogicalLayout, _spec.Layout],
    mesh: Any,
    rules: Optional[AxisRules],
    where: str = "the type hint",
) -> tuple[frozenset, frozenset]:
    """The mesh axes a value must be unreduced and reduced over: a `Layout`'s
    own; a `LogicalLayout`'s logical names (`Logical(unreduced=...)`) resolved
    by the rules, each to its first candidate's axes (a name no rule maps is a
    mesh axis only in NNX metadata, as for dims)."""
    if isinstance(layout, _spec.Layout):
        return layout.unreduced, layout.reduced
    if not any(layout.pending):
        return frozenset(), frozenset()
    axes = None if mesh is None else tuple(mesh.axis_names)
    rules = rules_for(layout, mesh, rules)
    out = []
    for kind, names in zip(("unreduced", "reduced"), layout.pending):
        found: set[str] = set()
        for name in names:
            candidates = rules.candidates(name) if rules is not None else None
            if not candidates:
                known = (
                    "no rules are in force"
                    if rules is None
                    else (
                        f"the axis rules {rules.describe(only=[name])} map it to no "
                        "mesh axis"
                    )
                )
                raise ShardingAnnotationError(
                    f"{where}: the logical name {name!r} in {kind}= names no mesh "
                    f"axis ({known}). Give it a rule (`jts.axis_rules({{{name!r}: "
                    "'data'}})`), or write the mesh axes in a PartitionSpec."
                )
            found.update(candidates[0])
        if axes is not None and not found <= set(axes):
            raise ShardingAnnotationError(
                f"{where}: {kind}= resolves to {sorted(found)!r}, not all axes of "
                f"the mesh ({', '.join(axes)})."
            )
        out.append(frozenset(found))
    return out[0], out[1]


def rules_for(
    layout: Any, axes: Any, rules: Optional[AxisRules]
) -> Optional[AxisRules]:
    """The rules a layout resolves by: those given, and for a `direct` layout (Flax
    NNX metadata) `axis -> axis` for each name with no rule that the mesh has
    (every such name when the mesh is not known), as Flax reads them."""
    if not isinstance(layout, LogicalLayout):
        return rules
    if layout.used and rules is not None:
        rules = rules.as_used()  # `jts.fsdp` names gathered
    if not layout.direct:
        return rules
    if axes is not None and not isinstance(axes, tuple):
        axes = (tuple(axes.axis_names), tuple(axes.axis_sizes))  # a mesh
    names = [n for n in layout.prefix + layout.suffix if n is not None]
    free = [n for n in names if rules is None or rules.candidates(n) is None]
    if axes is not None:
        free = [n for n in free if n in axes[0]]
    return (rules or AxisRules({})).with_mesh_axes(free)


def depends_on_shape(
    layout: Union[LogicalLayout, _spec.Layout], rules: Optional[AxisRules]
) -> bool:
    """Whether `resolve` may give another answer with the shape than with the
    rank alone: a logical layout under rules that test divisibility (a name with
    several candidates, or `conflicts="fallback"`)."""
    if isinstance(layout, _follows.FollowsLayout):
        return True  # a dim of size 1 is replicated
    if not isinstance(layout, LogicalLayout):
        return False
    rules = rules_for(layout, None, rules)
    if rules is None:
        return False
    if rules.conflicts == "fallback":
        return True
    if rules.linen:
        return False  # Linen pairs test divisibility only under "fallback"
    names = layout.prefix + layout.suffix
    return any(len(rules.candidates(n) or ()) > 1 for n in names if n is not None)


def physical_layout(
    layout: LogicalLayout,
    shape: Shape,
    mesh: Any,
    rules: Optional[AxisRules],
    where: str = "the type hint",
) -> _spec.Layout:
    """`resolve`, as a `_spec.Layout` whose text says where the spec came from."""
    entries = resolve(layout, shape, mesh, rules, where)
    if isinstance(layout, _follows.FollowsLayout):
        return _followed_layout(layout, entries, rules)
    ndim = shape if isinstance(shape, int) else len(shape)
    names = [n for n in layout.names(ndim) if n is not None]
    names += [n for group in layout.pending for n in group]  # `unreduced=` too
    ruled = [n for n in names if rules is not None and rules.candidates(n)]
    if layout.direct and not ruled:
        how = "its names taken as mesh axes"
    else:
        shown = rules_for(layout, mesh, rules)
        assert shown is not None  # resolve raised otherwise
        only = ruled if layout.direct else names
        how = f"by the axis rules {shown.describe(only=only)}"
        if layout.direct and len(ruled) < len(names):
            how += ", other names taken as mesh axes"
    unreduced, reduced = pending(layout, mesh, rules, where)
    shown = _spec.format_entries(entries)
    if unreduced or reduced:
        shown = _spec.format_spec(_spec.make_spec(entries, unreduced, reduced))
    text = f"{shown} (from {layout.text} {how}{_short_metadata(layout, ndim)})"
    return _spec.Layout(entries, (), text, unreduced, reduced)


def _followed_layout(
    layout: "_follows.FollowsLayout", entries: _spec.Entries, rules: Any
) -> _spec.Layout:
    how = ""
    field = layout.field
    if isinstance(field, LogicalLayout):
        names = [n for n in field.names(layout.rank(len(entries))) if n is not None]
        shown = rules_for(field, None, rules)
        if shown is not None:
            how = f" by the axis rules {shown.describe(only=names)}"
    text = (
        f"{_spec.format_entries(entries)} (following {layout.text}{how}: its dims "
        "lined up from the right, a dim of size 1 replicated)"
    )
    return _spec.Layout(entries, (), text)


def _short_metadata(layout: LogicalLayout, ndim: int) -> str:
    """For NNX metadata naming fewer dims than the array has: its names go to
    the leading dims, so a stack whose axis `nnx.vmap` / `nnx.scan` did not
    insert reads a layer's names off by the stack (issue 33, item 5)."""
    named = layout.min_rank
    if not layout.direct or ndim <= named or not any(layout.prefix):
        return ""
    extra = ndim - named
    return (
        f"; that metadata names {named} of the array's {ndim} dims, so dim 0 "
        f"reads as `{layout.prefix[0]}`: if the array is a stack of layers, its "
        f"{extra} stacked axis{'es are' if extra > 1 else ' is'} missing from "
        "out_sharding. Stack with `transform_metadata={nnx.PARTITION_NAME: "
        "'layers'}` on `nnx.vmap` / `nnx.scan` (and a rule for 'layers'); if "
        "not, name every dim of the Variable, None where replicated"
    )


@functools.lru_cache(maxsize=4096)
def _resolve(
    layout: LogicalLayout,
    shape: Shape,
    axes: Optional[tuple[tuple[str, ...], tuple[int, ...]]],
    rules: Optional[AxisRules],
    where: str,
    held: tuple = (),
) -> _spec.Entries:
    ndim = shape if isinstance(shape, int) else len(shape)
    names = layout.names(ndim)
    sizes = _validate(layout, names, axes, rules, where)
    assert rules is not None  # `_validate` raised otherwise
    return _assign(names, shape, sizes, rules, layout, where, held)


def check_resolvable(
    layout: Union[LogicalLayout, _spec.Layout],
    mesh: Any,
    rules: Optional[AxisRules],
    where: str,
) -> None:
    """Raises the `ShardingAnnotationError` that resolving `layout` by rank gives,
    where the array's shape cannot change it: no rules, a name with no rule, a
    rule naming an axis `mesh` lacks, two dims on one axis under
    `conflicts="error"` when every name has one candidate. (With fallback lists
    a shape may resolve a conflict the rank alone cannot: left to the check.)"""
    if not isinstance(layout, LogicalLayout) or isinstance(
        layout, _follows.FollowsLayout
    ):
        return  # a leaf following a field: resolved with the leaf's shape
    axes = None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
    rules = rules_for(layout, axes, rules)
    names = layout.names(layout.min_rank)
    sizes = _validate(layout, names, axes, rules, where)
    assert rules is not None  # `_validate` raised otherwise
    named = [n for n in names if n is not None]
    if rules.linen or all(len(rules.candidates(n) or ()) == 1 for n in named):
        _assign(names, layout.min_rank, sizes, rules, layout, where)


def _validate(layout, names, axes, rules, where) -> Optional[dict]:
    """The checks of a resolution that no shape changes; the mesh's axis sizes."""
    named = [n for n in names if n is not None]
    if rules is None:
        example = ", ".join(f"{n!r}: ..." for n in dict.fromkeys(named)) or "..."
        raise ShardingAnnotationError(
            f"{where} names its dims logically ({layout.text}), but no axis rules "
            f"are in force. Set them around the call, `with jts.axis_rules"
            f"({{{example}}}):`, or for the process, `jts.set_axis_rules(...)`; a "
            "rule maps a logical name to mesh axes, or to None to replicate."
            + _conflicts.linen_note(layout, names, None)
        )
    unknown = [n for n in dict.fromkeys(named) if rules.candidates(n) is None]
    if unknown:
        listed = ", ".join(repr(n) for n in unknown)
        raise ShardingAnnotationError(
            f"{where}: no axis rule for logical name{'s' if len(unknown) > 1 else ''} "
            f"{listed} ({layout.text}). The rules in force: {rules.describe()}. Add "
            f"a rule for each: mesh axes to shard it, or None to replicate it on "
            f"purpose (e.g. {{{', '.join(f'{n!r}: None' for n in unknown)}}})."
            + (" The mesh has no such axis either." if layout.direct else "")
            + _conflicts.flax_note(layout, names, rules)
            + _conflicts.linen_note(layout, names, rules)
        )
    sizes = None if axes is None else dict(zip(*axes))
    if sizes is not None:
        _check_mesh_axes(named, rules, sizes, axes, where)
    return sizes


def _check_mesh_axes(named, rules, sizes, axes, where) -> None:
    for name in dict.fromkeys(named):
        for candidate in rules.candidates(name):
            for axis in candidate:
                if axis not in sizes:
                    mesh_text = (
                        "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(*axes)) + ")"
                    )
                    raise ShardingAnnotationError(
                        f"{where}: the axis rule {name!r} -> "
                        f"{format_candidate(candidate)} names mesh axis {axis!r}, "
                        f"but the mesh {mesh_text} has no such axis. Fix the rules "
                        f"for this mesh (in force: {rules.describe()})."
                    )


def _assign(names, shape, sizes, rules, layout, where, held=()) -> _spec.Entries:
    ndim = len(names)
    known = None if isinstance(shape, int) or sizes is None else shape
    entries: list[Optional[Candidate]] = [None if n else () for n in names]
    holder: dict[str, int] = {}  # mesh axis -> the dim that holds it
    stack = dict(held)  # mesh axis -> the stacked dim that holds it (taken first)
    # Per dim, each candidate refused: (candidate, why, the dim holding its axis).
    tried: dict[int, list[tuple[Candidate, str, Optional[int]]]] = {
        i: [] for i in range(ndim)
    }

    def attempt(i: int, candidate: Candidate, divide: bool) -> bool:
        for axis in candidate:
            if axis in stack:
                why = f"{axis!r} is taken by the leaf's stacked dim {stack[axis]}"
                tried[i].append((candidate, why, _conflicts.STACKED))
                return False
            if axis in holder:
                k = holder[axis]
                why = f"{axis!r} is taken by dim {k} (`{names[k]}`)"
                tried[i].append((candidate, why, k))
                return False
        if divide and known is not None and sizes is not None:
            n = math.prod(sizes[a] for a in candidate)
            if known[i] % n:
                why = f"its {n} shards do not divide dim {i}'s size {known[i]}"
                tried[i].append((candidate, why, None))
                return False
        entries[i] = candidate
        for axis in candidate:
            holder[axis] = i
        return True

    fallback = rules.conflicts == "fallback"
    if rules.linen:
        # Flax Linen: the pairs in order of priority, each to the first dim of
        # its name still unassigned.
        for name, candidate in rules.pairs:
            for i in range(ndim):
                if names[i] == name and entries[i] is None:
                    if attempt(i, candidate, fallback):
                        break
    else:
        for i in range(ndim):
            if entries[i] is None:
                options = rules.candidates(names[i])
                divide = fallback or len(options) > 1
                for candidate in options:
                    if attempt(i, candidate, divide):
                        break
    for i in range(ndim):
        if entries[i] is None:
            if rules.conflicts == "error":
                why = _conflicts.conflict_message(
                    i, names, tried[i], rules, layout, where
                )
                raise ShardingAnnotationError(why)
            entries[i] = ()
    return tuple(e if e is not None else () for e in entries)
