"""PartitionSpec helpers: validation, normalisation, and JAX's own notation."""

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from jax.sharding import PartitionSpec

from ._errors import ShardingAnnotationError


# One entry per array dim: the mesh axes that dim is split over, in order.
Entries = tuple[tuple[str, ...], ...]

_SPEC_FORMS = (
    "A sharding is written as a `jax.sharding.PartitionSpec`, one entry per leading "
    "dim: `None` (not sharded), a mesh axis name (`'data'`), or a tuple of them "
    "(`('data', 'fsdp')`), e.g. `Float[Array, \"batch embed\", P('data', None)]`."
)


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


def validate_spec(spec: Any, where: str) -> Entries:
    """Checks a third subscription argument; returns its entries.

    `where` names the annotation in the error, e.g. `Float[Array, 'b e', ...]`.
    """
    if not isinstance(spec, PartitionSpec):
        raise ShardingAnnotationError(_not_a_spec_message(spec, where))
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ShardingAnnotationError(
            f"{where}: {format_spec(spec)} has `unreduced`/`reduced` axes, which "
            "jaxtyping_shard does not check yet. Annotate the layout without them."
        )
    seen: set[str] = set()
    for entry in spec:
        names: Sequence[Any]
        if entry is None:
            continue
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ShardingAnnotationError(
                f"{where}: `P.UNCONSTRAINED` is a request to XLA, not a layout to "
                "check. Write `None` for a dim that must not be sharded, or leave "
                "the sharding argument out."
            )
        names = (entry,) if isinstance(entry, str) else entry
        if not isinstance(names, tuple) or len(names) == 0:
            raise ShardingAnnotationError(
                f"{where}: the spec entry {entry!r} is not a mesh axis name. "
                + _SPEC_FORMS
            )
        for name in names:
            if not isinstance(name, str) or not name:
                raise ShardingAnnotationError(
                    f"{where}: the spec entry {entry!r} holds {name!r}, which is not "
                    "a mesh axis name (a non-empty string). " + _SPEC_FORMS
                )
            if name in seen:
                raise ShardingAnnotationError(
                    f"{where}: mesh axis {name!r} is used twice in "
                    f"{format_spec(spec)}; a mesh axis can shard at most one dim "
                    "(to split one dim over several axes, write them as one tuple "
                    f"entry, e.g. P(({name!r}, 'other'), None))."
                )
            seen.add(name)
    return entries_of(spec)


def _not_a_spec_message(spec: Any, where: str) -> str:
    got = f"got {type(spec).__name__} {spec!r}"
    fix = ""
    if type(spec).__name__ == "NamedSharding":
        fix = (
            " The mesh is never written in the annotation; it is found from the "
            "array or the context. Pass just the spec: `sharding.spec`."
        )
    elif isinstance(spec, (tuple, list)):
        inner = ", ".join(repr(x) for x in spec)
        fix = f" Wrap the entries: `P({inner})`."
    elif isinstance(spec, str):
        fix = f" Wrap the axis name: `P({spec!r})` shards the first dim over {spec!r}."
    return (
        f"{where}: the third argument must be a jax.sharding.PartitionSpec, {got}."
        f"{fix} {_SPEC_FORMS}"
    )


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
