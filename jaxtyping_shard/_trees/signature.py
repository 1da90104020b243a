"""What a function's signature says: the type hint of each parameter.

The one reading of a signature, shared by the `jaxtyping_shard.jit` boundary
checks, its derived shardings, `typed_shard_map` and `place_for`. Read through
decorators (`jaxtyped`, `jax.jit`, `jts.jit` are unwrapped), through
`functools.partial` (the arguments it binds are not the caller's: bound
positionally, they leave the signature; by keyword, they are `fixed`) and
through callable objects (the hints of their class's `__call__`). Each hint is
resolved on its own (`reading`): one that cannot be read is named once per
function in a `ShardingWarning` and declares nothing, and the others are read.
"""

import dataclasses
import functools as ft
import inspect
import threading
import typing
import weakref
from collections.abc import Callable
from typing import Any, Optional

from .._core.errors import ShardingAnnotationError
from . import hints as _hints, reading as _reading


@dataclasses.dataclass(frozen=True, eq=False)
class Signature:
    name: str  # how the function is named in messages
    parameters: Optional[inspect.Signature]  # as the callable is called
    hints: dict  # parameter (or "return") -> a hint the walk can follow
    unread: dict  # parameter (or "return") -> `reading.Unread`
    fixed: frozenset  # keyword arguments a `functools.partial` supplies

    def hint(self, parameter: str) -> Any:
        return self.hints.get(parameter)

    def arguments(self, args: tuple, kwargs: dict) -> list:
        """`[(parameter, value, hint), ...]` for the arguments of one call; the
        hint of `*args` as `tuple[h, ...]`, of `**kwargs` as `dict[str, h]`."""
        if self.parameters is None:
            return [(f"args[{i}]", a, None) for i, a in enumerate(args)] + [
                (k, v, None) for k, v in kwargs.items()
            ]
        try:
            bound = self.parameters.bind(*args, **kwargs)
        except TypeError:  # let the call itself raise its own error
            return []
        out = []
        for name, value in bound.arguments.items():
            hint = self.hints.get(name)
            kind = self.parameters.parameters[name].kind
            if hint is not None and kind is inspect.Parameter.VAR_POSITIONAL:
                hint = tuple[hint, ...]
            elif hint is not None and kind is inspect.Parameter.VAR_KEYWORD:
                hint = dict[str, hint]
            out.append((name, value, hint or self.unread.get(name)))
        return out


def read(fn: Callable) -> Signature:
    """`fn`'s signature and hints, through wrappers, partials and `__call__`."""
    target: Any = fn
    fixed: set = set()
    for _ in range(100):  # a chain of wrappers, bounded as `inspect.unwrap` is
        wrapped = getattr(target, "__wrapped__", None)
        if isinstance(target, ft.partial):
            fixed |= set(target.keywords)
            target = target.func
        elif wrapped is not None:
            target = wrapped
        else:
            break
    if not (inspect.isroutine(target) or isinstance(target, type)) and callable(target):
        source = type(target).__call__  # a callable object
        name = f"{type(target).__qualname__}.__call__"
    else:
        source = target.__init__ if isinstance(target, type) else target
        name = getattr(target, "__qualname__", None) or repr(target)
    try:
        parameters: Optional[inspect.Signature] = inspect.signature(fn)
    except (TypeError, ValueError):
        parameters = None
    hints, unread = _function_hints(source, name)
    return Signature(name, parameters, hints, unread, frozenset(fixed))


def parameter_hint(fn: Callable, parameter: str, what: str) -> Any:
    """The type hint of `fn`'s parameter, through decorators; an error if there is
    none, or it cannot be read."""
    signature = read(fn)
    if parameter in signature.unread:
        raise ShardingAnnotationError(
            f"{what}: {signature.unread[parameter]}. Make the names it uses exist "
            "at run time (not only under `TYPE_CHECKING`)."
        )
    hint = signature.hint(parameter)
    if hint is None:
        names = list(signature.parameters.parameters) if signature.parameters else []
        kind = "is not annotated" if parameter in names else "is not a parameter"
        raise ShardingAnnotationError(
            f"{what}: {parameter!r} {kind} of {signature.name} (parameters: "
            f"{', '.join(names) or 'none'}). Annotate the parameter with its layout."
        )
    return hint


def function_name(fn: Any) -> str:
    return read(fn).name


# Per function: its hints, read once (and its unreadable ones warned about once).
_read: "weakref.WeakKeyDictionary[Any, tuple[dict, dict]]" = weakref.WeakKeyDictionary()
_read_lock = threading.Lock()


def _function_hints(source: Any, name: str) -> tuple[dict, dict]:
    """`(hints the walk can follow, unread)` of a function."""
    source = getattr(source, "__func__", source)  # a bound method's function
    try:
        return _read[source]
    except (KeyError, TypeError):  # not read yet, or not weakly referable
        pass
    raw = _reading.function_hints(source, name) if source is not None else {}
    unread = {k: v for k, v in raw.items() if isinstance(v, _reading.Unread)}
    hints = {k: v for k, v in raw.items() if k not in unread and _usable(v)}
    if _reading.third_party(source):
        hints = {k: v for k, v in hints.items() if _reading.declares_sharding(v)}
        unread = {}
    out = (hints, unread)
    try:
        with _read_lock:
            first = source not in _read
            _read[source] = out
    except TypeError:  # not weakly referable: read at every use
        first = True
    if first and unread:
        _hints.warn_unread(list(unread.values()), f"`{name}`", "parameters")
    return out


def _usable(hint: Any) -> bool:
    # A hint the walk can follow: a class or a generic alias (not a TypeVar, a
    # string left unresolved, or a literal).
    return isinstance(hint, type) or (
        typing.get_origin(hint) is not None
        and typing.get_origin(hint) is not typing.Literal
    )
