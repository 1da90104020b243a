"""What a function's signature says: the type hint of each parameter.

Read through decorators (`jaxtyped`, `jax.jit`, `jts.jit` are unwrapped), for
the drivers that take a layout from a consumer's signature (`place_for`,
`jts.jit`'s derived shardings).
"""

import inspect
import typing
from collections.abc import Callable
from typing import Any

from .._core.errors import ShardingAnnotationError


def parameter_hint(fn: Callable, parameter: str, what: str) -> Any:
    """The type hint of `fn`'s parameter, through decorators."""
    target = inspect.unwrap(fn)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception as error:
        raise ShardingAnnotationError(
            f"{what}: the annotations of {function_name(fn)} cannot be resolved "
            f"({type(error).__name__}: {error})."
        ) from None
    if parameter not in hints:
        try:
            names = list(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            names = []
        kind = "is not annotated" if parameter in names else "is not a parameter"
        raise ShardingAnnotationError(
            f"{what}: {parameter!r} {kind} of {function_name(fn)} (parameters: "
            f"{', '.join(names) or 'none'}). Annotate the parameter with its layout."
        )
    return hints[parameter]


def function_name(fn: Any) -> str:
    return getattr(inspect.unwrap(fn), "__qualname__", None) or repr(fn)
