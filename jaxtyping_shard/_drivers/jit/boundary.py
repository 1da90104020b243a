"""Tree checks at a function's boundary: what `jaxtyping_shard.jit` adds.

`checked(fun)` is `fun` with every leaf inside its arguments and its result that
has a sharded annotation checked: from the annotations of its parameters and
return value (type hints such as `dict[str, Float[...]]` or `list[Block]`) and
from the field annotations of the dataclasses and Equinox modules inside them. A
parameter annotated as one array (`x: Float[Array, "b e", P("data")]`) is left
to the function's own checker (`jaxtyped`), which checks it already. Under
`jax.jit` the wrapper runs when the function is traced, once per new input
signature, and compiles to nothing: a steady-state call does not run it.
"""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

from ..._annotation.entry import Entry
from ..._core.modes import current_mode
from ..._trees import check_tree as _check_tree, hints as _hints, walk as _tree


def checked(fun: Callable) -> Callable:
    """`fun`, checking the sharded leaves of its arguments and result."""
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", repr(fun))
    where = f"jaxtyping_shard.jit({name})"
    info: list = []  # (signature, hints), read at the first call
    entry = Entry(fun, _hints.field_hints)

    @ft.wraps(fun)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        if current_mode() == "off":
            return fun(*args, **kwargs)
        entry.check(args, kwargs)  # every logical annotation resolves, first
        if not info:
            info.append(_read(fun))
        signature, hints = info[0]
        failures: list = []
        total = 0
        for param, value, hint in _arguments(signature, hints, args, kwargs):
            found, count = _failures(value, hint, param, name, False)
            failures += found
            total += count
        if failures:
            raise _check_tree.error(f"{where}, arguments", failures, total)
        out = fun(*args, **kwargs)
        found, count = _failures(out, hints.get("return"), "return", name, True)
        if found:
            raise _check_tree.error(f"{where}, return value", found, count)
        return out

    return boundary


def _failures(
    value: Any, hint: Any, name: str, function: str, is_return: bool
) -> tuple[list, int]:
    if _hints.leaf_annotation(hint) is not None:
        # A parameter (or return) annotated as one array is the function's own
        # checker's to check (jaxtyped, beartype, typeguard); checking it here too
        # would report each of its mismatches twice.
        return [], 0
    leaves, plan = _tree.plan_for(value, hint)
    checkers = _check_tree.checkers_of(plan, sharded_only=True)
    count = sum(c is not None for c in checkers)
    if not count:
        return [], 0
    found = _check_tree.leaf_failures(
        leaves, plan.paths, checkers, name, function, is_return
    )
    return found, count


def _read(fun: Callable) -> tuple[Optional[inspect.Signature], dict]:
    try:
        signature: Optional[inspect.Signature] = inspect.signature(fun)
    except (TypeError, ValueError):
        signature = None
    try:
        hints = typing.get_type_hints(fun, include_extras=True)
    except Exception:  # unresolvable names: field annotations still apply
        hints = {}
    usable = {k: v for k, v in hints.items() if _usable(v)}
    if signature is not None:
        for param in signature.parameters.values():
            hint = usable.get(param.name)
            if hint is None:
                continue
            if param.kind is param.VAR_POSITIONAL:
                usable[param.name] = tuple[hint, ...]
            elif param.kind is param.VAR_KEYWORD:
                usable[param.name] = dict[str, hint]
    return signature, usable


def _usable(hint: Any) -> bool:
    # A hint the walk can follow: a class or a generic alias (not a TypeVar, a
    # string left unresolved, or a literal).
    return isinstance(hint, type) or (
        typing.get_origin(hint) is not None
        and typing.get_origin(hint) is not typing.Literal
    )


def _arguments(
    signature: Optional[inspect.Signature], hints: dict, args: tuple, kwargs: dict
) -> list:
    if signature is None:
        return [(f"args[{i}]", a, None) for i, a in enumerate(args)] + [
            (k, v, None) for k, v in kwargs.items()
        ]
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # let the call itself raise its own error
        return []
    return [(k, v, hints.get(k)) for k, v in bound.arguments.items()]
