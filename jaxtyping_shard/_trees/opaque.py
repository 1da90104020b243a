"""Leaves that hide arrays from every walk: dataclasses JAX does not flatten.

`opaque(leaves, paths)` is what `walk.problems` adds to a plan's problems, per
call (the plan's key, the tree's structure, cannot tell such a leaf from an
array).
"""

import dataclasses
from typing import Any

import jax


def opaque(leaves: list, paths: tuple) -> list:
    """`[(key path, reason), ...]` for leaves that are dataclasses JAX does not
    flatten (not registered as pytrees) holding arrays: one leaf to every function
    that walks trees, whose arrays none can see. Per call: the plan's key (the
    tree's structure) cannot tell such a leaf from an array."""
    out: list = []
    if not any(map(_is_dataclass_type, set(map(type, leaves)))):
        return out  # the common case, a few types: no per-leaf work in Python
    for leaf, path in zip(leaves, paths):
        if _is_dataclass_type(type(leaf)):
            held = _arrays_in(leaf, 0)
            if held:
                out.append((path, _opaque_reason(leaf, held)))
    return out


def _is_dataclass_type(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) and not issubclass(cls, type)


def _arrays_in(obj: Any, depth: int) -> list:
    """The names of the fields of an unregistered dataclass that hold arrays."""
    names = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, None)
        inner = jax.tree_util.tree_leaves(value)
        if any(_is_array(x) for x in inner) or (
            depth < 4
            and any(
                dataclasses.is_dataclass(x)
                and not isinstance(x, type)
                and _arrays_in(x, depth + 1)
                for x in inner
            )
        ):
            names.append(field.name)
    return names


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _opaque_reason(leaf: Any, fields: list) -> str:
    cls = type(leaf)
    return (
        f"a `{cls.__module__}.{cls.__qualname__}`, a dataclass that is not registered "
        "as a pytree, so JAX (and this check) sees it as one leaf and never its "
        f"array fields ({', '.join(fields)}). Register it: "
        "`@jax.tree_util.register_dataclass` above `@dataclasses.dataclass` (or "
        "make it an `equinox.Module`)"
    )
