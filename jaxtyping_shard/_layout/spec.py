"""Layouts as data, and JAX's own notation for them.

A `Layout` is the sharding an annotation asks for (spec entries per dim); a
`LogicalLayout` names its dims logically, for the rules to resolve. Here too:
spec entries, their normalisation and formatting (`float32[8@data,4]`), and
whether an annotation carries a layout at all. Imports nothing of the package.
"""

import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from jax.sharding import NamedSharding, PartitionSpec


# `Union[A, B]` and `A | B`: what `typing.get_origin` of a union hint returns
# (the one definition; every module that asks imports it from here).
UNION_TYPES: tuple[Any, ...] = (Union, types.UnionType)


# One entry per array dim: the mesh axes that dim is split over, in order.
Entries = tuple[tuple[str, ...], ...]


def entries_of(spec: PartitionSpec) -> Entries:
    """The spec as a tuple of tuples of axis names (`None` becomes `()`).

    `unreduced` / `reduced` axes are not part of it: see `unreduced_axes`.
    """
    out = []
    # Iterating a spec with unreduced axes raises; `.partitions` never does.
    for entry in getattr(spec, "partitions", spec):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


def only_axes(spec: PartitionSpec, keep: frozenset) -> PartitionSpec:
    """`spec` with only the mesh axes in `keep` (JAX's APIs each take the axes of
    one type; `shard_map` its manual ones)."""
    entries = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        kept = tuple(n for n in names if n in keep)
        entries.append(kept[0] if len(kept) == 1 else kept or None)
    return PartitionSpec(*entries)


def unreduced_axes(spec: Any) -> frozenset:
    """Mesh axes over which a value is `unreduced` (a sum is still pending).

    `reduced` axes are not among them: a `reduced` value is replicated over them
    (only its transpose is unreduced), which is how JAX compares shardings too.
    """
    return frozenset(getattr(spec, "unreduced", ()) or ())


def axes_of(entries: Entries) -> tuple[str, ...]:
    return tuple(name for entry in entries for name in entry)


def normalise(
    entries: Entries,
    ndim: int,
    sizes: Mapping[str, int],
    keep: Optional[frozenset[str]] = None,
) -> Entries:
    """`ndim` entries, dropping mesh axes of size 1 (and those not in `keep`).

    Two specs with the same normalised form place the same shards on the same
    devices of one mesh; this is how trace-time checks compare abstract shardings.
    """
    out = []
    for i in range(ndim):
        entry = entries[i] if i < len(entries) else ()
        out.append(
            tuple(
                a for a in entry if sizes.get(a, 1) != 1 and (keep is None or a in keep)
            )
        )
    return tuple(out)


def _format_entry(entry: tuple[str, ...]) -> str:
    if len(entry) == 0:
        return "None"
    if len(entry) == 1:
        return repr(entry[0])
    return "(" + ", ".join(repr(a) for a in entry) + ")"


def format_entries(entries: Entries) -> str:
    return "P(" + ", ".join(_format_entry(e) for e in entries) + ")"


def format_spec(spec: PartitionSpec) -> str:
    """Formats a spec as it is written: `P('data', None)`, `P(('x', 'y'),)`."""
    try:
        entries = entries_of(spec)
    except (TypeError, ValueError):  # not a spec, or one with unreduced axes
        return repr(spec)
    if len(entries) == 1 and len(entries[0]) > 1:
        return "P(" + _format_entry(entries[0]) + ",)"
    return format_entries(entries)


def format_array(dtype: Any, shape: Sequence[int], entries: Entries) -> str:
    """An array summarised as JAX prints it: `float32[8@data,4]`, `8@(x,y)`."""
    dims = []
    for i, size in enumerate(shape):
        entry = entries[i] if i < len(entries) else ()
        if len(entry) == 0:
            dims.append(str(size))
        elif len(entry) == 1:
            dims.append(f"{size}@{entry[0]}")
        else:
            dims.append(f"{size}@({','.join(entry)})")
    name = getattr(dtype, "name", None) or str(dtype)
    return f"{name}[{','.join(dims)}]"


def indivisible(
    shape: Sequence[int], spec: PartitionSpec, sizes: Mapping[str, int], dtype: Any
) -> Optional[str]:
    """Why `spec` cannot lay out an array of `shape` on a mesh of axis `sizes` (a
    dim its mesh axes do not divide, with the padded shape that would), or None.
    JAX refuses such an array as a `jit` argument or result."""
    entries = entries_of(spec)
    bad = []
    padded = list(shape)
    for dim, entry in enumerate(entries):
        n = math.prod(sizes[a] for a in entry)
        if n > 1 and shape[dim] % n:
            padded[dim] = -(-shape[dim] // n) * n
            axes = entry[0] if len(entry) == 1 else "(" + ",".join(entry) + ")"
            bad.append(f"dim {dim} ({shape[dim]}) is not divisible by {axes}={n}")
    if not bad:
        return None
    want = format_array(dtype, shape, entries)
    return (
        f"`{want}`: {'; '.join(bad)}. Pad it to "
        f"{tuple(padded)} (round each such dim up to a multiple of its mesh axes' "
        "size), or shard that dim over other axes."
    )


class Layout:
    """The sharding an annotation asks for, rank-independent.

    `prefix` shards the leading dims (a `PartitionSpec` gives only this); `suffix`
    shards the trailing dims after a variadic dim (`"*lead seq@model"`). The spec
    for an array of rank `ndim` pads between the two with `None`.
    """

    __slots__ = ("prefix", "suffix", "text", "axes", "min_rank", "_specs")

    def __init__(self, prefix: Entries, suffix: Entries, text: str):
        # Unsharded dims at the open ends say nothing: P("x") == P("x", None).
        while prefix and not prefix[-1]:
            prefix = prefix[:-1]
        while suffix and not suffix[0]:
            suffix = suffix[1:]
        self.prefix = prefix
        self.suffix = suffix
        self.text = text
        self.axes = axes_of(prefix) + axes_of(suffix)
        self.min_rank = len(prefix) + len(suffix)
        self._specs: dict[int, tuple[Entries, PartitionSpec]] = {}

    def entries(self, ndim: int) -> Entries:
        return self._for(ndim)[0]

    def spec(self, ndim: int) -> PartitionSpec:
        return self._for(ndim)[1]

    def _for(self, ndim: int) -> tuple[Entries, PartitionSpec]:
        try:
            return self._specs[ndim]
        except KeyError:
            pass
        if not self.suffix:
            entries = self.prefix
        else:
            pad = ((),) * (ndim - self.min_rank)
            entries = self.prefix + pad + self.suffix
        spec = PartitionSpec(*(_entry_to_spec(e) for e in entries))
        self._specs[ndim] = (entries, spec)
        return entries, spec

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (self.prefix, self.suffix) == (other.prefix, other.suffix)

    def __hash__(self) -> int:
        return hash((self.prefix, self.suffix))

    def __repr__(self) -> str:
        return f"Layout({self.text})"


def _entry_to_spec(entry: tuple[str, ...]) -> Any:
    if len(entry) == 0:
        return None
    if len(entry) == 1:
        return entry[0]
    return entry


Names = tuple[Optional[str], ...]


class LogicalLayout:
    """The logical names of an annotation's dims, rank-independent.

    Like `Layout`: `prefix` names the dims before a variadic dim, `suffix`
    those after it. It has no spec of its own: `resolve` gives one. `direct`: a
    name with no rule that names an axis of the mesh is that axis, as Flax NNX
    reads its `out_sharding` metadata (`_trees/nnx.py`). `used`: resolved as
    used (`jts.Used`): a name whose rule is `jts.fsdp(...)` gets no mesh axes.
    """

    __slots__ = (
        "prefix",
        "suffix",
        "variadic",
        "text",
        "min_rank",
        "direct",
        "used",
        "_hash",
    )

    def __init__(
        self,
        prefix: Names,
        suffix: Names,
        variadic: bool,
        text: str,
        direct: bool = False,
        used: bool = False,
    ):
        self.prefix = prefix
        self.suffix = suffix
        self.variadic = variadic
        self.text = text
        self.direct = direct
        self.used = used
        self.min_rank = len(prefix) + len(suffix)
        self._hash = hash((prefix, suffix, variadic, direct, used))

    def names(self, ndim: int) -> Names:
        if not self.variadic:
            return self.prefix
        pad = (None,) * max(0, ndim - self.min_rank)
        return self.prefix + pad + self.suffix

    def as_used(self) -> "LogicalLayout":
        """This layout read as used (`jts.Used`)."""
        if self.used:
            return self
        text = f"jts.Used[{self.text}]"
        return LogicalLayout(
            self.prefix, self.suffix, self.variadic, text, self.direct, True
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogicalLayout):
            return NotImplemented
        return (self.prefix, self.suffix, self.variadic, self.direct, self.used) == (
            other.prefix,
            other.suffix,
            other.variadic,
            other.direct,
            other.used,
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"LogicalLayout({self.text})"


def sharded_members(annotation: Any) -> tuple[Any, ...]:
    """The sharded annotation classes in `annotation` (several for a union)."""
    if hasattr(annotation, "_jts"):
        return (annotation,)
    if typing.get_origin(annotation) in UNION_TYPES:
        return tuple(m for m in typing.get_args(annotation) if hasattr(m, "_jts"))
    return ()


class Lead:
    """The annotation of a stacked leaf (`stacked=`, `jts.Stacked`): `lead`, one
    spec entry (mesh axes) per extra leading dim, then `inner` (the annotation of
    one layer) for the dims after them. Made by the tree walk only; `spec_for`
    resolves it, the tree checks check it (`_trees.stacked.LeadCheck`)."""

    __slots__ = ("inner", "lead")

    def __init__(self, inner: Any, lead: tuple):
        self.inner, self.lead = inner, tuple(lead)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lead) and (self.inner, self.lead) == (
            other.inner,
            other.lead,
        )

    def __hash__(self) -> int:
        return hash((Lead, self.inner, self.lead))

    def __repr__(self) -> str:
        return f"Lead({self.inner!r}, {self.lead!r})"


def held_axes(lead: tuple) -> tuple[tuple[str, int], ...]:
    """`(mesh axis, stacked dim)` for each mesh axis a stack's entries hold."""
    out = []
    for j, entry in enumerate(lead):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.extend((axis, j) for axis in axes)
    return tuple(out)


STACK_FIXES = (
    "Fixes: stack over another mesh axis (`stacked={pattern: ('pipe',)}`, "
    "`jts.Stacked[Block, ('pipe',)]`) or replicate the stack (`1`); or shard "
    "that dim of the layer over another axis."
)


def held_conflict(entries: Entries, held: tuple, lead: tuple, where: str) -> str:
    """Why a physical layout's `entries` cannot follow its stack ("" if they
    can): one uses a mesh axis the stack holds (`held`, `held_axes(lead)`)."""
    stack = dict(held)
    for i, entry in enumerate(entries):
        for axis in entry:
            if axis in stack:
                return (
                    f"{where} shards its dim {i} over mesh axis {axis!r}, which the "
                    f"leaf's stacked dim {stack[axis]} already holds (the stack "
                    f"{format_spec(PartitionSpec(*lead))}); a mesh axis "
                    f"can shard at most one dim of an array. {STACK_FIXES}"
                )
    return ""


def has_sharding(annotation: Any) -> bool:
    """Whether `annotation` says anything about a sharding (a stacked leaf's
    does: its leading dims, and replicated where its layer's says nothing)."""
    return isinstance(annotation, (PartitionSpec, NamedSharding, Lead)) or bool(
        sharded_members(annotation)
    )


def is_variadic(dim: str) -> bool:
    """Whether a jaxtyping dim (`*batch`, `...`, `#*b`) stands for any number."""
    return dim == "..." or dim.lstrip("#?_").startswith("*")
