"""A function's logical annotations, return included, resolved when it is entered.

A logical annotation means nothing until a rules table and a mesh resolve it, and
some tables cannot: a name with no rule, a rule naming an axis the mesh lacks, two
dims on one axis under `conflicts="error"`. Resolved only when a value meets it,
the return annotation's error would come after the body ran, behind whatever JAX
raises in the body first, naming neither the rule nor the annotation. So where
this library owns a function's entry (`jaxtyping_shard.jaxtyped`, the boundary of
`jaxtyping_shard.jit`), every logical annotation of the signature is resolved
first, with the rules in force and the call's mesh, by rank: the errors raised
then are those the array's shape cannot change (`resolve.check_resolvable`).
"""

import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import jax
import jaxtyping
from jax.core import Tracer

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._core.modes import mode_reader
from .._layout import resolve as _resolve
from .._layout.spec import UNION_TYPES
from .._rules.scope import current as _current_rules


_PYTREE: Any = type(jaxtyping.PyTree[int])
_SEEN_LIMIT = 64


class Entry:
    """The logical annotations of one function's signature, checked on entry.

    Read at the first call (the names a hint uses may be defined after the
    function), through decorators; `fields(cls)` gives a class's field hints, for
    callers that check the fields of modules and dataclasses.
    """

    def __init__(self, fn: Callable, fields: Optional[Callable] = None):
        self._fn = inspect.unwrap(fn)
        self._fields = fields
        self.name = getattr(self._fn, "__qualname__", None) or repr(fn)
        self.annotations: Optional[list[tuple[str, Any]]] = None
        self._resolved: set = set()  # (rules, mesh) under which all resolve

    def check(self, args: tuple, kwargs: dict) -> None:
        """Raises `ShardingAnnotationError` for the first annotation of the
        signature that the rules in force cannot resolve on the call's mesh."""
        if mode_reader.value == "off":
            return
        if self.annotations is None:
            self.annotations = _logical_signature(self._fn, self._fields)
        if not self.annotations:
            return
        rules = _current_rules()
        mesh = _call_mesh(args, kwargs)
        key = (rules, mesh)
        if key in self._resolved:
            return
        for what, cls in self.annotations:
            where = f"{what} of `{self.name}` ({cls.__name__})"
            try:
                _resolve.check_resolvable(cls._jts, mesh, rules, where)
            except ShardingAnnotationError as error:
                on = "no mesh" if mesh is None else f"mesh {_mesh.format_mesh(mesh)}"
                raise ShardingAnnotationError(
                    f"{error} ({on}; resolved when `{self.name}` was entered, "
                    "before its body ran.)"
                ) from None
        if len(self._resolved) >= _SEEN_LIMIT:
            self._resolved.clear()
        self._resolved.add(key)


def _logical_signature(target: Callable, fields: Optional[Callable]) -> list:
    """`(what, annotation)` for each logical annotation of `target`'s signature."""
    hints = _hints_of(target)
    try:
        parameters = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        parameters = [k for k in hints if k != "return"]
    found: list[tuple[str, Any]] = []
    for parameter in [*parameters, "return"]:
        if parameter not in hints:
            continue
        what = (
            "the return annotation"
            if parameter == "return"
            else f"the annotation of parameter `{parameter}`"
        )
        for cls in logical_annotations(hints[parameter], fields):
            found.append((what, cls))
    return found


def _hints_of(target: Callable) -> dict:
    try:
        return typing.get_type_hints(target, include_extras=True)
    except Exception:  # a name that cannot be resolved: use the others as written
        raw = getattr(target, "__annotations__", None) or {}
        return {k: v for k, v in raw.items() if not isinstance(v, str)}


def logical_annotations(hint: Any, fields: Optional[Callable] = None) -> list:
    """The logical annotation classes a hint holds for sure: through `Annotated`,
    `Optional`, generic arguments (`list[T]`, `dict[K, V]`, `tuple[A, B]`),
    jaxtyping's `PyTree[T]` and, with `fields`, the field hints of classes. Not
    the members of a union: which one applies is the value's to say."""
    found: list = []
    seen: set = set()

    def visit(h: Any, depth: int) -> None:
        if depth > 32:
            return
        origin = typing.get_origin(h)
        if origin is typing.Annotated:
            visit(typing.get_args(h)[0], depth + 1)
        elif origin in UNION_TYPES:
            members = [m for m in typing.get_args(h) if m is not type(None)]
            if len(members) == 1:
                visit(members[0], depth + 1)
        elif isinstance(h, type) and getattr(h, "_jts_logical", False):
            if h not in found:
                found.append(h)
        elif isinstance(h, _PYTREE):
            visit(getattr(h, "leaftype", None), depth + 1)
        elif origin is not None:
            for argument in typing.get_args(h):
                visit(argument, depth + 1)
        elif isinstance(h, type) and fields is not None and h not in seen:
            seen.add(h)
            try:
                hints = fields(h)
            except ShardingAnnotationError:
                return  # unreadable fields: the tree walk says so when it meets one
            for field in hints.values():
                visit(field, depth + 1)

    visit(hint, 0)
    return found


def _call_mesh(args: tuple, kwargs: dict) -> Any:
    """The mesh the call's values are checked on: the context's, else that of the
    first argument placed on (or traced over) one."""
    mesh = _mesh.context_mesh()
    if mesh is not None:
        return mesh
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tracer):  # never read a tracer's `.sharding` (slow)
            mesh = _mesh.of_aval(jax.typeof(value))
        else:
            mesh = getattr(getattr(value, "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None
