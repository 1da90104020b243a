"""`Tree[T]`: a parameter hint whose every leaf is checked, for `jaxtyped`.

beartype and typeguard check a class hint (`model: Mlp`) with `isinstance`, which
looks at the class only, never at the fields; they check one element of a
`list[T]` and one value of a `dict[str, T]`. `Tree[Mlp]` is a class whose
`isinstance` is `isinstance(x, Mlp)` plus `check_tree(x, Mlp)`: every leaf
against its field annotation (or against the hint, for `Tree[dict[str, A]]`).
Static type checkers see `Tree[T]` as `T` (see `_annotation.indirection`).
"""

import typing
from typing import Any

import jaxtyping

from .._core.errors import ShardingAnnotationError
from .._core.modes import current_mode
from .._layout.spec import UNION_TYPES
from . import (
    check_tree as _check_tree,
    hints as _hints,
    leaves as _leaves,
    paths as _paths,
    walk as _tree,
)


class _MetaTree(type):
    _jts_hint: Any = None
    _jts_class: Any = None

    def __getitem__(cls, hint: Any) -> Any:
        if cls._jts_hint is not None:
            raise ShardingAnnotationError(f"{cls.__name__} is already subscripted.")
        origin: Any = _class_of(hint)
        if typing.get_origin(hint) in UNION_TYPES:
            # `Tree[A | QuantArray]`: either member, walked as the union (`hints`).
            origin = tuple(_class_of(m) for m in typing.get_args(hint))
            if not all(isinstance(m, type) for m in origin):
                origin = None
        if not isinstance(origin, (type, tuple)):
            raise ShardingAnnotationError(
                f"Tree[...] takes a class or a generic alias such as `Mlp` or "
                f"`dict[str, Float[Array, 'e m', P('data')]]`, not {hint!r}."
            )
        shown = getattr(hint, "__qualname__", None) or repr(hint).replace("typing.", "")
        name = f"Tree[{shown}]"
        out = _MetaTree(name, (), {"_jts_hint": hint, "_jts_class": origin})
        out.__module__ = "jaxtyping_shard"
        return out

    def __instancecheck__(cls, obj: Any) -> bool:
        return cls.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(cls, obj: Any) -> str:
        if cls._jts_hint is None:
            raise ShardingAnnotationError(
                "Write `Tree[T]` with the class or type of the tree, e.g. `Tree[Mlp]`."
            )
        if not isinstance(obj, cls._jts_class):
            kind = type(obj)
            return (
                f"this value is a {kind.__module__}.{kind.__qualname__}, not a "
                f"{cls._jts_hint!r}"
            )
        if current_mode() == "off":
            return ""
        leaves, plan = _tree.plan_for(obj, cls._jts_hint)
        checkers = _check_tree.checkers_of(plan)
        structure = [
            f"`{_paths.path_name('', path)}`: {reason}"
            for path, reason in _tree.problems(leaves, plan)
        ]
        failures = _leaves.leaf_failures(
            leaves, plan.paths, checkers, "", name_sites=False
        )
        parts = []
        if structure:
            parts.append(f"its type hint does not fit it: {'; '.join(structure)}")
        if failures:
            total = sum(c is not None for c in checkers)
            listed = "; ".join(f"`{path}`: {reason}" for path, reason in failures)
            parts.append(
                f"{len(failures)} of its {total} checked leaves do not match: {listed}"
            )
        return "; ".join(parts)

    def __repr__(cls) -> str:
        return f"jaxtyping_shard.{cls.__name__}"


def _class_of(hint: Any) -> Any:
    """The class `isinstance` tests for a hint (a generic alias's origin)."""
    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type) and issubclass(origin, jaxtyping.AbstractArray):
        # The array type alone: the annotation's own check comes with the walk.
        kind = origin.array_type
        return kind if isinstance(kind, type) else object
    if _hints.is_typeddict(origin):
        return dict  # a TypedDict's values are dicts; it refuses `isinstance`
    return type(None) if origin is None else origin


class Tree(metaclass=_MetaTree):
    """A type hint for a whole tree, every leaf checked: `model: Tree[Mlp]`.

    !!! Example

        ```python
        import dataclasses
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts
        from beartype import beartype
        from jaxtyping import Array, jaxtyped
        from jaxtyping_shard import Float

        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Mlp:
            w: Float[Array, "embed mlp@model"]

        @jaxtyped(typechecker=beartype)
        def apply(mlp: jts.Tree[Mlp], x: Float[Array, "b embed"]):
            return x @ mlp.w
        ```

    `isinstance(x, Tree[T])` is `isinstance(x, T)` (the origin class for a generic
    alias) and [`jaxtyping_shard.check_tree`][]`(x, T)`: every leaf, with the
    annotations of the fields of the classes inside and of the type arguments
    (`Tree[dict[str, Float[Array, "e m", P("data")]]]` checks every value). A
    union is walked as a field hinted with it is: `Tree[Float[Array, "e m",
    jts.Logical] | QuantArray]` checks an array as the array member and a
    `QuantArray` by its fields (see [`jaxtyping_shard.FollowsField`][]).
    beartype and typeguard call it like any class; static type checkers read
    `Tree[T]` as `T`.
    """
