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
    for entry in partitions_of(spec):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


def partitions_of(spec: Any) -> tuple:
    """A spec's entries as written. JAX 0.10 refuses to iterate a spec with
    unreduced axes (`.partitions` then); JAX 0.8 has no `.partitions`."""
    return tuple(getattr(spec, "partitions", spec))


def only_axes(spec: PartitionSpec, keep: frozenset) -> PartitionSpec:
    """`spec` with only the mesh axes in `keep` (JAX's APIs each take the axes of
    one type; `shard_map` its manual ones), unreduced / reduced ones included."""
    entries = []
    for entry in partitions_of(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        entries.append(tuple(n for n in names if n in keep))
    return make_spec(
        tuple(entries), unreduced_axes(spec) & keep, reduced_axes(spec) & keep
    )


def unreduced_axes(spec: Any) -> frozenset:
    """Mesh axes over which a value is `unreduced` (a sum is still pending).

    `reduced` axes are not among them: a `reduced` value is replicated over them
    (only its transpose is unreduced), which is how JAX compares shardings too.
    """
    return frozenset(getattr(spec, "unreduced", ()) or ())


def reduced_axes(spec: Any) -> frozenset:
    """Mesh axes a value is `reduced` over: replicated, its cotangent unreduced."""
    return frozenset(getattr(spec, "reduced", ()) or ())


def pending_of(spec: Any) -> tuple[frozenset, frozenset]:
    return unreduced_axes(spec), reduced_axes(spec)


def make_spec(
    entries: Entries, unreduced: Any = (), reduced: Any = ()
) -> PartitionSpec:
    """The `PartitionSpec` of entries, with `unreduced` / `reduced` axes if any."""
    parts = (e[0] if len(e) == 1 else e or None for e in entries)
    if not unreduced and not reduced:
        return PartitionSpec(*parts)
    return PartitionSpec(
        *parts, unreduced=frozenset(unreduced), reduced=frozenset(reduced)
    )


def format_pending(unreduced: Any, reduced: Any) -> str:
    """JAX's notation for pending axes, as `jax.typeof` prints them after the
    shape: `{U:data}`, `{U:(data,fsdp)}`, `{U:data, R:model}`; "" if none."""
    parts = []
    for tag, axes in (("U", unreduced), ("R", reduced)):
        if axes:
            names = sorted(axes)
            shown = names[0] if len(names) == 1 else "(" + ",".join(names) + ")"
            parts.append(f"{tag}:{shown}")
    return "{" + ", ".join(parts) + "}" if parts else ""


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
    except (TypeError, ValueError):  # not a spec
        return repr(spec)
    if len(entries) == 1 and len(entries[0]) > 1:
        body = _format_entry(entries[0]) + ","
    else:
        body = ", ".join(_format_entry(e) for e in entries)
    for kind, axes in zip(("unreduced", "reduced"), pending_of(spec)):
        if axes:
            names = ", ".join(repr(a) for a in sorted(axes))
            body += f"{', ' if body else ''}{kind}={{{names}}}"
    return f"P({body})"


def format_array(
    dtype: Any, shape: Sequence[int], entries: Entries, spec: Any = None
) -> str:
    """An array summarised as JAX prints it: `float32[8@data,4]`, `8@(x,y)`,
    with `spec`'s unreduced / reduced axes after it: `float32[4,2]{U:data}`."""
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
    pending = format_pending(*pending_of(spec))
    return f"{name}[{','.join(dims)}]{pending}"


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
    for an array of rank `ndim` pads between the two with `None`. `unreduced` /
    `reduced`: the mesh axes the value must be unreduced / reduced over (JAX's
    `PartitionSpec(unreduced=..., reduced=...)`; Explicit axes only).
    """

    __slots__ = (
        *("prefix", "suffix", "text", "axes", "min_rank", "_specs"),
        *("unreduced", "reduced"),
    )

    def __init__(
        self,
        prefix: Entries,
        suffix: Entries,
        text: str,
        unreduced: frozenset = frozenset(),
        reduced: frozenset = frozenset(),
    ):
        # Unsharded dims at the open ends say nothing: P("x") == P("x", None).
        while prefix and not prefix[-1]:
            prefix = prefix[:-1]
        while suffix and not suffix[0]:
            suffix = suffix[1:]
        self.prefix = prefix
        self.suffix = suffix
        self.text = text
        self.unreduced = frozenset(unreduced)
        self.reduced = frozenset(reduced)
        # Every mesh axis it names (a mesh lacking one cannot hold the value).
        pending = tuple(sorted(self.unreduced | self.reduced))
        self.axes = axes_of(prefix) + axes_of(suffix) + pending
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
        spec = make_spec(entries, self.unreduced, self.reduced)
        self._specs[ndim] = (entries, spec)
        return entries, spec

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._key() == other._key()

    def _key(self) -> tuple:
        return (self.prefix, self.suffix, self.unreduced, self.reduced)

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Layout({self.text})"


Names = tuple[Optional[str], ...]


class LogicalLayout:
    """The logical names of an annotation's dims, rank-independent.

    Like `Layout`: `prefix` names the dims before a variadic dim, `suffix`
    those after it. It has no spec of its own: `resolve` gives one. `direct`: a
    name with no rule that names an axis of the mesh is that axis, as Flax NNX
    reads its `out_sharding` metadata (`_trees/nnx.py`). `used`: resolved as
    used (`jts.Used`): a name whose rule is `jts.fsdp(...)` gets no mesh axes.
    `pending`: the logical names the value is unreduced and reduced over (two
    tuples), resolved to mesh axes by the same rules (`resolve.pending`).
    """

    __slots__ = (
        "prefix",
        "suffix",
        "variadic",
        "text",
        "min_rank",
        "direct",
        "used",
        "pending",
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
        pending: tuple = ((), ()),
    ):
        self.prefix = prefix
        self.suffix = suffix
        self.variadic = variadic
        self.text = text
        self.direct = direct
        self.used = used
        self.pending = pending
        self.min_rank = len(prefix) + len(suffix)
        self._hash = hash(self._key())

    def _key(self) -> tuple:
        return (self.prefix, self.suffix, self.variadic) + (
            (self.direct, self.used, self.pending)
        )

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
            *(self.prefix, self.suffix, self.variadic, text),
            *(self.direct, True, self.pending),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogicalLayout):
            return NotImplemented
        return self._key() == other._key()

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


def has_sharding(annotation: Any) -> bool:
    """Whether `annotation` says anything about a sharding (a stacked leaf's
    does: its leading dims, and replicated where its layer's says nothing)."""
    return isinstance(annotation, (PartitionSpec, NamedSharding, Lead)) or bool(
        sharded_members(annotation)
    )


def is_variadic(dim: str) -> bool:
    """Whether a jaxtyping dim (`*batch`, `...`, `#*b`) stands for any number."""
    return dim == "..." or dim.lstrip("#?_").startswith("*")
