"""What static type checkers see: each dtype is `typing.Annotated`.

`Float[Array, "b e", P("data")]` then reads as `Annotated[Array, "b e",
P("data")]`, which pyright and mypy accept and treat as `Array`. jaxtyping does the
same for its own dtypes.
"""

from typing import (
    Annotated,
    Annotated as BFloat16,
    Annotated as Bool,
    Annotated as Complex,
    Annotated as Complex64,
    Annotated as Complex128,
    Annotated as Float,
    Annotated as Float8e4m3b11fnuz,
    Annotated as Float8e4m3fn,
    Annotated as Float8e4m3fnuz,
    Annotated as Float8e5m2,
    Annotated as Float8e5m2fnuz,
    Annotated as Float16,
    Annotated as Float32,
    Annotated as Float64,
    Annotated as Inexact,
    Annotated as Int,
    Annotated as Int2,
    Annotated as Int4,
    Annotated as Int8,
    Annotated as Int16,
    Annotated as Int32,
    Annotated as Int64,
    Annotated as Integer,
    Annotated as Key,
    Annotated as Num,
    Annotated as Real,
    Annotated as Shaped,
    Annotated as UInt,
    Annotated as UInt2,
    Annotated as UInt4,
    Annotated as UInt8,
    Annotated as UInt16,
    Annotated as UInt32,
    Annotated as UInt64,
    TYPE_CHECKING,
    TypeAlias,
    TypeVar,
)


if not TYPE_CHECKING:  # pragma: no cover
    raise ImportError("jaxtyping_shard._indirection is for static type checkers only")

_T = TypeVar("_T")
# `Tree[Mlp]` reads as `Mlp`.
Tree: TypeAlias = Annotated[_T, "jaxtyping_shard.Tree"]
# `Stacked[Block]` reads as `Block` (the one-argument form: an alias takes one).
Stacked: TypeAlias = Annotated[_T, "jaxtyping_shard.Stacked"]

__all__ = [
    "BFloat16", "Bool", "Complex", "Complex64", "Complex128", "Float",
    "Float8e4m3b11fnuz", "Float8e4m3fn", "Float8e4m3fnuz", "Float8e5m2",
    "Float8e5m2fnuz", "Float16", "Float32", "Float64", "Inexact", "Int", "Int2",
    "Int4", "Int8", "Int16", "Int32", "Int64", "Integer", "Key", "Num", "Real",
    "Shaped", "UInt", "UInt2", "UInt4", "UInt8", "UInt16", "UInt32", "UInt64",
    "Stacked", "Tree",
]  # fmt: skip
