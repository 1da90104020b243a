"""Annotations read one at a time: one that cannot be read declares nothing.

`typing.get_type_hints` resolves a class's or a function's annotations all
together, and fails for all of them when one names something it cannot find (a
name imported under `TYPE_CHECKING` with `from __future__ import annotations`;
optax's state classes, whose `ArrayTree` is defined in another module). Here
each annotation is resolved on its own, so the others are still read; the one
that fails becomes an `Unread`, which declares nothing below it.

Whose annotation it is decides whether that is said (`docs/trees.md`, "Hints
that cannot be read"):

- a class or function defined in an installed package (a file under
  `site-packages` / `dist-packages`, or Python's standard library) is a third
  party's: what it cannot resolve declares nothing, without a word, and of its
  annotations only those that declare a sharding are read at all (a field is
  the class's that defines it, also in a subclass of the user's);
- anything else is the user's: an annotation whose own text names something
  that cannot be found is an `Unread`, which the readers warn about once per
  class or function. One that resolves, but holds a forward reference of
  another package's alias that does not (`optax.OptState`), declares what it
  can and says nothing.
"""

import dataclasses
import functools as ft
import inspect
import os
import re
import sys
import sysconfig
import types
import typing
from typing import Any

from .._layout.spec import has_sharding


@dataclasses.dataclass(frozen=True)
class Unread:
    """An annotation that cannot be read: it declares nothing below it."""

    where: str  # "parameter `opt` of `step`", "field `mu` of `mod.State`"
    reason: str  # "NameError: name 'OptState' is not defined"

    def __str__(self) -> str:
        return f"the annotation of {self.where} cannot be read ({self.reason})"


def class_hints(cls: type) -> dict:
    """`typing.get_type_hints(cls, include_extras=True)`, entry by entry; of the
    fields a class of an installed package defines (`cls` or a base), only those
    whose hint declares a sharding."""
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:
        hints = _entry_by_entry(cls)
    owners = {field: base for base in reversed(cls.__mro__) for field in _own(base)}
    return {
        field: hint
        for field, hint in hints.items()
        if not third_party(owners.get(field, cls))
        or (not isinstance(hint, Unread) and declares_sharding(hint))
    }


def _own(cls: type) -> dict:
    try:
        return inspect.get_annotations(cls)
    except Exception:  # pragma: no cover - a class whose annotations raise
        return {}


def _entry_by_entry(cls: type) -> dict:
    module = getattr(sys.modules.get(cls.__module__), "__dict__", {})
    name = f"`{cls.__module__}.{cls.__qualname__}`"
    hints: dict = {}
    for base in reversed(cls.__mro__):
        base_module = getattr(sys.modules.get(base.__module__), "__dict__", module)
        # As `get_type_hints` does for a class: module globals first, then the
        # class's own namespace.
        namespace = dict(vars(base))
        for field, value in _own(base).items():
            probe = type(
                "probe",
                (),
                {
                    "__annotations__": {field: value},
                    "__module__": base.__module__,
                    "__type_params__": getattr(base, "__type_params__", ()),
                },
            )
            where = f"field `{field}` of {name}"
            hints[field] = _one(probe, field, value, namespace, base_module, where)
    return hints


def function_hints(fn: Any, name: str) -> dict:
    """`typing.get_type_hints(fn, include_extras=True)`, entry by entry (`fn`:
    a plain function, unwrapped)."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        pass
    try:
        own = inspect.get_annotations(fn)
    except Exception:
        return {}
    namespace = getattr(fn, "__globals__", {})
    hints: dict = {}
    for param, value in own.items():
        probe = types.SimpleNamespace(
            __annotations__={param: value},
            __type_params__=getattr(fn, "__type_params__", ()),
        )
        what = "the return annotation" if param == "return" else f"parameter `{param}`"
        hints[param] = _one(probe, param, value, namespace, None, f"{what} of `{name}`")
    return hints


def _one(probe: Any, key: str, value: Any, globalns: dict, localns: Any, where: str):
    """One annotation resolved as `get_type_hints` would, or what of it can be."""
    try:
        return typing.get_type_hints(
            probe, globalns=globalns, localns=localns, include_extras=True
        )[key]
    except Exception as error:
        failure = error
    text = value.__forward_arg__ if isinstance(value, typing.ForwardRef) else value
    if not isinstance(text, str):
        # Written as an object that exists: what fails is a forward reference
        # inside it (another package's alias, `optax.OptState`): what it declares
        # is read, the reference declares nothing.
        return value
    try:
        written = eval(text, globalns, localns)  # the annotation as written
    except Exception as error:
        return Unread(where, f"{type(error).__name__}: {error}")
    missing = getattr(failure, "name", None)
    if isinstance(failure, NameError) and missing in re.findall(r"[A-Za-z_]\w*", text):
        # A name of its own text, quoted once more (`list["Block"]`).
        return Unread(where, f"{type(failure).__name__}: {failure}")
    return written


def declares_sharding(hint: Any, depth: int = 0) -> bool:
    """Whether a hint says anything about a sharding (inside its arguments too)."""
    if depth > 8:
        return False
    if has_sharding(hint) or getattr(hint, "_jts", None) is not None:
        return True
    leaf = getattr(hint, "leaftype", None)  # jaxtyping's PyTree[T]
    if leaf is not None and declares_sharding(leaf, depth + 1):
        return True
    try:
        args = typing.get_args(hint)
    except Exception:  # pragma: no cover - a hint typing cannot take apart
        return False
    return any(declares_sharding(a, depth + 1) for a in args)


def third_party(obj: Any) -> bool:
    """Whether a class or function is defined in an installed package."""
    return _installed_module(getattr(obj, "__module__", None) or "")


@ft.lru_cache(maxsize=1024)
def _installed_module(name: str) -> bool:
    if name.partition(".")[0] == __name__.partition(".")[0]:
        return False  # this library's own annotations are read as the user's
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or not path:
        # A module without a file: `__main__` of a notebook, or a builtin one.
        return name in sys.builtin_module_names
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    stdlib = [sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")]
    return any(p and path.startswith(os.path.realpath(p) + os.sep) for p in stdlib)
