"""`Logical`: dims named logically, parsed into a `LogicalLayout`.

`Float[Array, "batch seq embed", Logical]` names each dim's logical axis by its dim
name; `Float[Array, "embed embed", Logical("embed", "embed_out")]` names them one
by one and leaves the size names alone. Which mesh axes a logical name means is
decided by the rules in force each time a value is checked (`resolve`).
"""

import re
from typing import Any, Optional

from .._core import compat as _compat
from .._core.errors import ShardingAnnotationError
from .spec import is_variadic, LogicalLayout


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class _LogicalMeta(type):
    def __repr__(cls) -> str:
        return "Logical"


class Logical(metaclass=_LogicalMeta):
    """Marks an annotation's dims as logical axis names, resolved by the rules.

    Bare, as the third argument, the dim names are the logical names:
    `Float[Array, "batch seq embed", Logical]`. Called, it gives one logical name
    per dim (or `None` for a dim never sharded) and leaves the dim names, which
    bind sizes, alone: `Float[Array, "embed embed", Logical("embed", "embed_out")]`
    is a square weight whose two dims are sharded by two different rules.

    The mesh axes come from the rules in force when a value is checked (see
    [`jaxtyping_shard.axis_rules`][]), never from the annotation.

    !!! Example

        ```python
        from jaxtyping import Array
        import jaxtyping_shard as jts
        from jaxtyping_shard import Float

        Activations = Float[Array, "batch seq embed", jts.Logical]
        Square = Float[Array, "embed embed", jts.Logical("embed", "embed_out")]
        ```


    `unreduced=` / `reduced=`: the logical names whose mesh axes (by the same
    rules) the value is unreduced / reduced over, as JAX's
    `PartitionSpec(unreduced=...)` says: `Logical(unreduced=("batch",))` (the
    dim names as logical names) or `Logical("embed", None, unreduced=("batch",))`.
    """

    __slots__ = ("names", "unreduced", "reduced")

    names: tuple[Optional[str], ...]
    unreduced: tuple[str, ...]
    reduced: tuple[str, ...]

    def __init__(
        self,
        *names: Optional[str],
        unreduced: Any = (),
        reduced: Any = (),
    ):
        pending = tuple(
            _pending_names(a, k)
            for a, k in ((unreduced, "unreduced"), (reduced, "reduced"))
        )
        if not names and not any(pending):
            raise ShardingAnnotationError(
                "Logical() needs one logical name per dim, e.g. "
                "Logical('embed', 'embed_out'); for the dim names themselves, write "
                "the bare `Logical`."
            )
        for name in names:
            if name is not None and not (
                isinstance(name, str) and _IDENTIFIER.match(name)
            ):
                raise ShardingAnnotationError(
                    f"Logical{names!r}: {name!r} is not a logical name; give an "
                    "identifier such as 'embed', or None for a dim never sharded."
                )
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "unreduced", pending[0])
        object.__setattr__(self, "reduced", pending[1])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Logical is immutable")

    def _key(self) -> tuple:
        return (self.names, self.unreduced, self.reduced)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __repr__(self) -> str:
        shown = [repr(n) for n in self.names]
        for kind in ("unreduced", "reduced"):
            if getattr(self, kind):
                shown.append(f"{kind}={getattr(self, kind)!r}")
        return f"Logical({', '.join(shown)})"

    def __reduce__(self) -> Any:
        return (_logical, (self.names, self.unreduced, self.reduced))


def _logical(names: tuple, unreduced: tuple, reduced: tuple) -> Logical:
    return Logical(*names, unreduced=unreduced, reduced=reduced)


def _pending_names(names: Any, kind: str) -> tuple[str, ...]:
    """`unreduced=` / `reduced=` as a sorted tuple of logical names."""
    if isinstance(names, str):
        names = (names,)
    try:
        out = tuple(sorted(set(names)))
    except TypeError:
        out = ()
        names = (names,)
    for name in names:
        if not (isinstance(name, str) and _IDENTIFIER.match(name)):
            raise ShardingAnnotationError(
                f"Logical({kind}={names!r}): {name!r} is not a logical name; give "
                f"identifiers, e.g. Logical({kind}=('batch',))."
            )
    missing = _compat.pending_axes_missing((kind,)) if out else ""
    if missing:
        raise ShardingAnnotationError(f"Logical({kind}={names!r}): {missing}")
    return out


Logical.__module__ = "jaxtyping_shard"


class MeshOrLogical(Logical):
    """Logical names where a rule names them, else mesh axes: how Flax NNX reads
    a Variable's `out_sharding` metadata (`_trees/nnx.py` makes these; not public).
    `source` says where the names were written, for messages."""

    __slots__ = ("source",)

    def __init__(self, *names: Optional[str], source: str = "NNX metadata"):
        super().__init__(*names)
        object.__setattr__(self, "source", source)

    def __repr__(self) -> str:
        return self.source

    def __reduce__(self) -> Any:  # pragma: no cover - made per Variable, not pickled
        return (_mesh_or_logical, (self.names, self.source))


def _mesh_or_logical(names: tuple, source: str) -> MeshOrLogical:
    return MeshOrLogical(*names, source=source)


class LinenNames(Logical):
    """Logical names that a Flax Linen `LogicallyPartitioned` box (or Linen's
    logical spec tree, `jts.logical_specs`) wrote (`_trees/linen.py` makes
    these; not public). `source` says where, for messages."""

    __slots__ = ("source",)

    def __init__(self, *names: Optional[str], source: str = "Linen"):
        super().__init__(*names)
        object.__setattr__(self, "source", source)

    def __repr__(self) -> str:
        return self.source

    def __reduce__(self) -> Any:  # pragma: no cover - made per box, not pickled
        return (_linen_names, (self.names, self.source))


def _linen_names(names: tuple, source: str) -> LinenNames:
    return LinenNames(*names, source=source)


# How a `MeshOrLogical` becomes an annotation class (`Shaped[Array, dims,
# marker]`): set by `_annotation/dtypes.py` when it is imported (the package's
# `__init__` imports it first). The tree walk (`_trees/nnx.py`) makes NNX
# metadata annotations through it: importing the annotation stage from the walk
# would make the chain of imports from `jaxtyping_shard.demo` 13 modules long
# (the house holds it to 10); the direction of imports is unchanged.
_annotation_maker: list = []


def register_annotation_maker(make: Any) -> None:
    _annotation_maker[:] = [make]


def annotation_for(dims: str, marker: Logical) -> Any:
    """The annotation class for `dims` and `marker` (`register_annotation_maker`)."""
    return _annotation_maker[0](dims, marker)


class AsUsed:
    """The third argument of an annotation made by `jts.Used[...]`: the logical
    marker it was written with (`Logical`, `Logical(...)`, NNX metadata), read
    as used (not public; pickles as itself)."""

    __slots__ = ("marker",)

    def __init__(self, marker: Any):
        object.__setattr__(self, "marker", marker)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("AsUsed is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsUsed) and self.marker == other.marker

    def __hash__(self) -> int:
        return hash(("AsUsed", self.marker))

    def __repr__(self) -> str:
        return f"jts.Used[{self.marker!r}]"

    def __reduce__(self) -> Any:
        return (AsUsed, (self.marker,))


def is_logical(arg: Any) -> bool:
    return arg is Logical or isinstance(arg, (Logical, AsUsed))


def _dim_name(dim: str) -> Optional[str]:
    # jaxtyping's modifiers: `#` broadcastable, `_` unchecked, `?` (older) ...
    name = dim.lstrip("#?_")
    return name if _IDENTIFIER.match(name) else None  # `3`, `_`, `n+1`: unnamed


def logical_layout(dim_str: str, marker: Any, where: str) -> LogicalLayout:
    """Parses `Logical` / `Logical(...)` against a (plain) dim string."""
    if isinstance(marker, AsUsed):
        return logical_layout(dim_str, marker.marker, where).as_used()
    dims = dim_str.split()
    variadic_at = next((i for i, d in enumerate(dims) if is_variadic(d)), None)
    pending = ((), ()) if marker is Logical else (marker.unreduced, marker.reduced)
    if marker is Logical or not marker.names:
        names: list[Optional[str]] = [
            None if i == variadic_at else _dim_name(d) for i, d in enumerate(dims)
        ]
        text = f"logical `{dim_str}`"
        if marker is not Logical:
            text += f" {marker!r}"
    else:
        if len(marker.names) != len(dims):
            raise ShardingAnnotationError(
                f"{where}: {marker!r} gives {len(marker.names)} logical names for "
                f"the {len(dims)} dims of {dim_str!r}; give one per dim (None for a "
                "dim never sharded)."
            )
        names = list(marker.names)
        if variadic_at is not None and names[variadic_at] is not None:
            raise ShardingAnnotationError(
                f"{where}: {marker!r} names the variadic dim "
                f"{dims[variadic_at]!r}, whose rank is not known; give None there."
            )
        text = f"{marker!r}"
    direct = isinstance(marker, MeshOrLogical)
    clash = set(pending[0]) & set(pending[1])
    clash |= (set(pending[0]) | set(pending[1])) & set(names)
    if clash:
        raise ShardingAnnotationError(
            f"{where}: {marker!r} names {sorted(clash)!r} twice (a dim's name and "
            "unreduced or reduced, or both of these); a value is unreduced or "
            "reduced over axes that shard none of its dims."
        )
    if variadic_at is None:
        return LogicalLayout(tuple(names), (), False, text, direct, False, pending)
    prefix = tuple(names[:variadic_at])
    suffix = tuple(names[variadic_at + 1 :])
    return LogicalLayout(prefix, suffix, True, text, direct, False, pending)
