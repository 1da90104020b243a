"""`FollowsField`: a container's leaves laid out as the field that holds them.

A field hinted `Float[Array, "embed mlp", Logical] | QuantArray` holds either the
weight or a container of its quantised form. The container's own fields say
that their layout is the field's, whatever field holds them:

    value: Int8[Array, "...", jts.FollowsField]   # the weight's dims
    scale: Float[Array, "...", jts.FollowsField]  # the dims it keeps

Written on its own, `Int8[Array, "...", FollowsField]` is jaxtyping's annotation
and declares no sharding (a tree check names its leaf as unannotated). The tree
walk, going down a union's container member, binds each such annotation to the
union's sharded array member (`Follows`): its layout is then a `FollowsLayout`,
resolved per array (`resolve.resolve`) by `align`, as broadcasting lines the
dims up: from the right, and a dim of size 1 replicated.
"""

from typing import Any, Optional

from .spec import LogicalLayout, Names


class _FollowsFieldMeta(type):
    def __repr__(cls) -> str:
        return "FollowsField"


class FollowsField(metaclass=_FollowsFieldMeta):
    """Marks a container's leaf as laid out like the field that holds the container.

    The third argument of an annotation on a field of a container class (a
    dataclass, an Equinox module, a registered pytree) that stands in for an
    array: `Int8[Array, "...", jts.FollowsField]`. When the container is the
    value of a field hinted as a union of a sharded array annotation and the
    container's class, the leaf's layout is that array annotation's, its dims
    lined up from the right as broadcasting does (`value * scale`), a dim of
    size 1 replicated:

    - a quantised value of the weight's shape follows every dim of the weight;
    - a per-channel scale of shape `(1, mlp)` or `(mlp,)` follows `mlp` only.

    Wherever no such field holds the container, the annotation is jaxtyping's
    (shape and dtype), and declares no sharding.

    !!! Example

        ```python
        import dataclasses
        import jax
        import jaxtyping_shard as jts
        from jaxtyping import Array
        from jaxtyping_shard import Float, Int8

        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class QuantArray:
            value: Int8[Array, "...", jts.FollowsField]
            scale: Float[Array, "...", jts.FollowsField]

        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Mlp:
            up: Float[Array, "embed mlp", jts.Logical] | QuantArray
        ```
    """


FollowsField.__module__ = "jaxtyping_shard"


class Follows:
    """The third argument of a `FollowsField` annotation once bound to a field's
    array annotation `member` (made by the tree walk only; pickles as itself)."""

    __slots__ = ("member",)

    def __init__(self, member: Any):
        object.__setattr__(self, "member", member)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Follows is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Follows) and self.member is other.member

    def __hash__(self) -> int:
        return hash(("Follows", id(self.member)))

    def __repr__(self) -> str:
        return f"FollowsField (of {self.member.__name__})"

    def __reduce__(self) -> Any:
        return (Follows, (self.member,))

    def layout(self) -> "FollowsLayout":
        member = self.member
        rank = None if member.index_variadic is not None else len(member.dims)
        return FollowsLayout(member._jts, rank, f"the field's `{member.__name__}`")


class FollowsLayout(LogicalLayout):
    """The layout of a leaf bound to a field's annotation: `field` (that
    annotation's `Layout` or `LogicalLayout`) and `field_rank` (its dims, `None`
    if variadic). Resolved per array by `resolve.resolve` (via `align`)."""

    __slots__ = ("field", "field_rank")

    def __init__(self, field: Any, field_rank: Optional[int], text: str):
        self.field = field
        self.field_rank = field_rank
        super().__init__((), (), True, text)

    def _key(self) -> tuple:
        return ("follows", self.field, self.field_rank)

    def names(self, ndim: int) -> Names:
        if isinstance(self.field, LogicalLayout):
            return align(self.field.names(self.rank(ndim)), ndim, None, None)
        return (None,) * ndim

    def rank(self, ndim: int) -> int:
        """The field's rank: its dim string's, or the leaf's when that is variadic."""
        return ndim if self.field_rank is None else self.field_rank

    def __repr__(self) -> str:
        return f"FollowsLayout({self.text})"


def is_marker(arg: Any, unbound: bool = True, bound: bool = True) -> bool:
    """Whether an annotation's third argument is `FollowsField` (`unbound`) or a
    `Follows` the walk made (`bound`)."""
    return (unbound and arg is FollowsField) or (bound and isinstance(arg, Follows))


def bound_layout(arg: Any) -> Optional[FollowsLayout]:
    """The layout of a `Follows` third argument; `None` for anything else."""
    return arg.layout() if isinstance(arg, Follows) else None


def align(items: tuple, ndim: int, shape: Optional[tuple], empty: Any) -> tuple:
    """The field's per-dim `items` (logical names or spec entries) for a leaf of
    rank `ndim`, lined up from the right; `empty` where the leaf has a dim the
    field lacks, or a dim of size 1 (`shape`, when known)."""
    out = []
    for i in range(ndim):
        j = i + len(items) - ndim
        item = items[j] if j >= 0 else empty
        if shape is not None and shape[i] == 1:
            item = empty
        out.append(item)
    return tuple(out)


def unbound(dtype: Any, base: type, array_type: Any, dim_str: str) -> Any:
    """`Float[Array, dims, FollowsField]`: jaxtyping's annotation `base` (no
    sharding), which the tree walk binds to the field holding its container
    (`_jts_follows_bind(member)`, cached per member)."""
    name = f"{base.__name__[:-1]}, FollowsField]"
    out: Any = type(base)(name, (base,), {})
    out.__qualname__ = name
    out.__module__ = "jaxtyping_shard"
    bound: dict = {}

    def bind(member: Any) -> Any:
        found = bound.get(member)
        if found is None:
            found = dtype[array_type, dim_str, Follows(member)]
            bound[member] = found
        return found

    out._jts_follows_bind = bind
    return out
