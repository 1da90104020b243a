"""An annotation as given, before any resolution: the layout it asks for
(`layout_of`, THE one place annotations are read), the rank its dim string
fixes, and how it is shown in messages."""

import functools as ft
from typing import Any, Optional, Union

from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from . import spec as _spec
from .spec import Lead, LogicalLayout, sharded_members
from .validate import spec_layout


_EXAMPLE = (
    "e.g. `Float[Array, \"batch embed\", P('data', None)]`, "
    '`Float[Array, "batch@data embed"]`, a `PartitionSpec` or a `NamedSharding`'
)


def describe(annotation: Any) -> str:
    """How an annotation is shown in messages."""
    if isinstance(annotation, Lead):
        n = len(annotation.lead)
        lead = _spec.format_spec(PartitionSpec(*annotation.lead))
        return (
            f"{describe(annotation.inner)} after {n} stacked dim{'s' * (n > 1)} {lead}"
        )
    if isinstance(annotation, PartitionSpec):
        return _spec.format_spec(annotation)
    if isinstance(annotation, NamedSharding):
        return f"NamedSharding(mesh {_mesh.format_mesh(annotation.mesh)}, " + (
            f"{_spec.format_spec(annotation.spec)})"
        )
    return getattr(annotation, "__name__", None) or repr(annotation)


def layout_of(annotation: Any, where: str = "") -> Union[_spec.Layout, LogicalLayout]:
    """The layout an annotation asks for. THE one place annotations are read.

    A logical annotation gives its `LogicalLayout`: `spec_for` resolves it.

    Accepts a sharded annotation class (`Float[Array, "b e", P("data")]`), a union
    of them with one layout (`Float[Array | np.ndarray, ...]`), a `PartitionSpec`
    or a `NamedSharding` (its spec).
    """
    if isinstance(annotation, NamedSharding):
        annotation = annotation.spec
    if isinstance(annotation, PartitionSpec):
        return _layout_of_spec(annotation)
    members = sharded_members(annotation)
    layouts = {m._jts for m in members}
    if len(layouts) == 1:
        return members[0]._jts
    prefix = f"{where}: " if where else ""
    if len(layouts) > 1:
        raise ShardingAnnotationError(
            f"{prefix}the union {describe(annotation)} holds several shardings, so "
            "it names no single layout. Give one sharding for every member."
        )
    raise ShardingAnnotationError(
        f"{prefix}{describe(annotation)} has no sharding, so it names no "
        f"PartitionSpec. Annotate with a sharding, {_EXAMPLE}."
    )


@ft.lru_cache(maxsize=1024)
def _layout_of_spec(spec: PartitionSpec) -> _spec.Layout:
    return spec_layout(spec, _spec.format_spec(spec))


def fixed_rank(annotation: Any) -> Optional[int]:
    """The rank the annotation's dim string fixes, or `None` if it is variadic."""
    if isinstance(annotation, Lead):
        inner = fixed_rank(annotation.inner)
        return None if inner is None else inner + len(annotation.lead)
    for member in sharded_members(annotation):
        if member.index_variadic is None:
            return len(member.dims)
    return None


def stack_hint(extra: int, pattern: Optional[str] = None) -> str:
    """What a rank error says when an array has `extra` more leading dims than
    its annotation: it may be a stack of layers, declared as such (`pattern`:
    the leaf's path, when the caller knows it)."""
    declared = f"{{{pattern!r}: {extra}}}" if pattern else f"{{pattern: {extra}}}"
    return (
        f"{STACK_HINT} (`eqx.filter_vmap`, `jax.lax.scan`), declare "
        f"its {extra} extra leading dim{'s' * (extra > 1)}: `stacked={declared}` "
        f"on the call, or once on the field: `jts.Stacked[Block"
        f"{'' if extra == 1 else f', {extra}'}]`."
    )


STACK_HINT = " If it is a stack of layers"
