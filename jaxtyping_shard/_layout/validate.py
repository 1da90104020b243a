"""A `PartitionSpec` written as an annotation's third argument, validated when
the annotation is written (a malformed one fails there, not at the check)."""

from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from .._core.errors import ShardingAnnotationError
from .spec import (
    Entries,
    entries_of,
    format_spec,
    Layout,
    partitions_of,
    reduced_axes,
    unreduced_axes,
)


_SPEC_FORMS = (
    "A sharding is written as a `jax.sharding.PartitionSpec`, one entry per leading "
    "dim: `None` (not sharded), a mesh axis name (`'data'`), or a tuple of them "
    "(`('data', 'fsdp')`), e.g. `Float[Array, \"batch embed\", P('data', None)]`."
)


def validate_spec(spec: Any, where: str) -> Entries:
    """Checks a third subscription argument; returns its entries.

    `where` names the annotation in the error, e.g. `Float[Array, 'b e', ...]`.
    """
    if not isinstance(spec, PartitionSpec):
        raise ShardingAnnotationError(_not_a_spec_message(spec, where))
    seen: set[str] = set()
    for kind, axes in (
        ("unreduced", unreduced_axes(spec)),
        ("reduced", reduced_axes(spec)),
    ):
        for name in sorted(axes, key=repr):
            if not isinstance(name, str) or not name:
                raise ShardingAnnotationError(
                    f"{where}: the {kind} axes of {format_spec(spec)} hold "
                    f"{name!r}, which is not a mesh axis name (a non-empty string)."
                )
        seen.update(axes)  # JAX refuses a spec that also shards over one
    for entry in partitions_of(spec):
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


def spec_layout(spec: Any, where: str, text: str = "") -> Layout:
    """The `Layout` of a spec, validated: its entries and its unreduced /
    reduced axes (`text`: how it is shown; default the spec as written)."""
    entries = validate_spec(spec, where)
    return Layout(
        entries,
        (),
        text or format_spec(spec),
        unreduced_axes(spec),
        reduced_axes(spec),
    )


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
