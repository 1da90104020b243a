"""What a type hint says about the leaves below it (for the one tree walk).

`leaf_annotation` reads one array's annotation out of a hint (`Annotated`,
`Optional`, jaxtyping's `PyTree[T]`, unions of sharded annotations);
`field_hints` reads a class's field annotations; `is_annotation_leaf` says where
an annotation tree ends.
"""

import dataclasses
import functools as ft
import types
import typing
from typing import Any, Union

import jaxtyping
from jax.sharding import NamedSharding, PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout.spec import format_spec, sharded_members
from .._layout.validate import validate_spec


UNION_TYPES: tuple[Any, ...] = (Union, types.UnionType)
PyTreeMeta: Any = type(jaxtyping.PyTree[int])


def is_annotation_leaf(x: Any) -> bool:
    """Whether `x` ends an annotation tree (not a container to descend into)."""
    if x is None or isinstance(x, (PartitionSpec, NamedSharding, type)):
        return True
    return typing.get_origin(x) is not None or isinstance(x, (str, typing.TypeVar))


@ft.lru_cache(maxsize=512)
def field_hints(cls: type) -> dict:
    """The type hints of a class's fields (`from __future__ import annotations` ok)."""
    if not getattr(cls, "__annotations__", None) and not dataclasses.is_dataclass(cls):
        return {}
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception as error:
        raise ShardingAnnotationError(
            f"The field annotations of {cls.__module__}.{cls.__qualname__} cannot be "
            f"resolved ({type(error).__name__}: {error}), so the shardings they "
            "declare cannot be read. Define the class, and the names its "
            "annotations use, at module level (names under `TYPE_CHECKING` are "
            "invisible at run time)."
        ) from None


def strip(hint: Any) -> Any:
    """`Annotated[T, ...]` -> `T`; `Optional[T]` -> `T`; `Any` -> None."""
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Annotated:
            hint = typing.get_args(hint)[0]
        elif origin in UNION_TYPES:
            members = [m for m in typing.get_args(hint) if m is not type(None)]
            if len(members) != 1:
                return hint
            hint = members[0]
        elif hint is typing.Any:
            return None
        else:
            return hint


def leaf_annotation(hint: Any) -> Any:
    """What a hint says about one array: an annotation to check, or `None`."""
    hint = strip(hint)
    if isinstance(hint, PyTreeMeta):
        return leaf_annotation(getattr(hint, "leaftype", None))
    if isinstance(hint, (PartitionSpec, NamedSharding)):
        return hint
    if isinstance(hint, type) and issubclass(hint, jaxtyping.AbstractArray):
        return hint
    if typing.get_origin(hint) in UNION_TYPES:
        members = [leaf_annotation(m) for m in typing.get_args(hint)]
        if any(m is not None for m in members) and sharded_members(hint):
            return hint
    return None


def validate_given(value: Any, what: str) -> None:
    if value is None or isinstance(value, (PartitionSpec, NamedSharding)):
        if isinstance(value, PartitionSpec):
            validate_spec(value, format_spec(value))
        return
    if leaf_annotation(value) is None and not isinstance(value, (type, PyTreeMeta)):
        if typing.get_origin(value) is None:
            raise ShardingAnnotationError(
                f"{what}: {value!r} is not an annotation, a PartitionSpec or a "
                "NamedSharding."
            )
