"""`jaxtyping_shard.jaxtyped`: jaxtyping's decorator, with the sharding reason in
the error it raises.

Why a wrapper: `jaxtyping.jaxtyped` builds its `TypeCheckError` message from the
parameter's name, a summary of its value and the annotation's name, and chains the
checker's own exception (which holds our reason) behind it. No public hook lets a
failed check add text to that message: the annotation's name is the same for every
value, and the value is the user's array. So `str(error)` of what jaxtyping raises
says `Actual value: f32[8,4]` and nothing about sharding. This wrapper calls
`jaxtyping.jaxtyped` unchanged and, when a sharding check made the call fail, raises
a `ShardingTypeCheckError` whose message starts with the reason, then jaxtyping's.
"""

import functools
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import jaxtyping

from .._core.errors import ShardingTypeCheckError
from .._core.failures import pop_records, push_records
from .._core.site import Site
from .entry import Entry


_SENTINEL: Any = object()
_PARAMETER = re.compile(
    r"^The problem arose whilst typechecking parameter '([^']+)'\.$", re.M
)
_RETURN = "Type-check error whilst checking the return value"
_TYPEGUARD_ARGUMENT = re.compile(r'^argument "([^"]+)"')


def jaxtyped(fn: Any = _SENTINEL, *, typechecker: Any = _SENTINEL) -> Any:
    """`jaxtyping.jaxtyped`, whose error message holds the sharding reason.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from beartype import beartype
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from jaxtyping import Array

        import jaxtyping_shard as jts
        from jaxtyping_shard import Float


        @jts.jaxtyped(typechecker=beartype)
        def double(x: Float[Array, "batch embed", P("data", None)]):
            return x * 2


        mesh = jax.make_mesh(
            (4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
        )
        bad = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("model")))
        try:
            double(bad)
        except jts.ShardingTypeCheckError as error:
            assert str(error).startswith("argument `x` of `double`: this array is")
        ```

    Takes exactly what `jaxtyping.jaxtyped` takes (a function, dataclass, method or
    property; `typechecker=beartype`, `typechecker=None`, or `"context"`) and behaves
    the same, except for one thing: when a sharding check fails the call, it raises
    a [`jaxtyping_shard.ShardingTypeCheckError`][] (a `jaxtyping.TypeCheckError`)
    whose message starts with the failing argument (and key path into it), then the
    reason (expected and actual sharding, the mesh, the fix), then jaxtyping's own
    message. Any other failure is jaxtyping's, unchanged.

    Under typeguard (`typechecker=None` over `@typechecked`) the error stays
    typeguard's: the reason is in its message already, and for a leaf of
    jaxtyping's `PyTree[...]` this decorator puts the leaf's key path and reason
    first.

    jaxtyping's import hook (`jaxtyping.install_import_hook`) decorates with
    `jaxtyping.jaxtyped` itself; under it the reason is in the chained checker
    exception only.
    """
    if fn is _SENTINEL:
        return functools.partial(jaxtyped, typechecker=typechecker)
    if isinstance(fn, str) or typechecker is _SENTINEL:
        # `jaxtyped("context")`, and the old double-decorator form (which warns).
        plain: Any = jaxtyping.jaxtyped
        if typechecker is _SENTINEL:
            return plain(fn)
        return plain(fn, typechecker=typechecker)
    if isinstance(fn, (classmethod, staticmethod)):
        return type(fn)(jaxtyped(fn.__func__, typechecker=typechecker))
    if isinstance(fn, property):
        parts = (fn.fget, fn.fset, fn.fdel)
        return property(
            *(p if p is None else jaxtyped(p, typechecker=typechecker) for p in parts)
        )
    checked = jaxtyping.jaxtyped(fn, typechecker=typechecker)
    if inspect.isclass(checked):
        init = checked.__init__
        if getattr(init, "_jts_reasons", False) or init is object.__init__:
            return checked
        checked.__init__ = _with_reasons(init, Entry(init))
        return checked
    return _with_reasons(checked, Entry(fn))


def _with_reasons(checked: Callable, entry: Entry) -> Callable:
    @functools.wraps(checked)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        entry.check(args, kwargs)  # every logical annotation resolves, first
        records = push_records()
        try:
            return checked(*args, **kwargs)
        except jaxtyping.TypeCheckError as error:
            if isinstance(error, ShardingTypeCheckError):
                raise
            message = _message(error, records)
            if message is None:
                message = _raised_by_a_check(error)
            if message is None:
                raise
            raise ShardingTypeCheckError(message) from error.__cause__
        except Exception as error:
            # typeguard's own error: our lookup put the reason of an annotation it
            # checked into it, but not of a leaf inside jaxtyping's `PyTree[...]`.
            message = _typeguard_message(error, records)
            if message is None:
                raise
            raise type(error)(message) from error
        finally:
            pop_records()

    wrapper._jts_reasons = True  # type: ignore[attr-defined]
    return wrapper


def _raised_by_a_check(error: Exception) -> Any:
    """A `ShardingTypeCheckError` that a check raised itself (a compile-time check
    run eagerly, under `grad` with no `jit`), which jaxtyping wrapped."""
    cause, seen = error.__cause__, 0
    while cause is not None and seen < 16:
        if isinstance(cause, ShardingTypeCheckError):
            return f"{cause}\n{error}"
        cause, seen = cause.__cause__, seen + 1
    return None


def _typeguard_message(error: Exception, records: list[tuple[Site, str]]) -> Any:
    typeguard = sys.modules.get("typeguard")
    if typeguard is None or type(error) is not typeguard.TypeCheckError:
        return None
    text = str(error)
    match = _TYPEGUARD_ARGUMENT.match(text)
    if match is not None:
        mine = [(s, r) for s, r in records if s.argument == match[1]]
    elif text.startswith("the return value"):
        mine = [(s, r) for s, r in records if s.is_return]
    else:
        return None
    return _prepend([(s, r) for s, r in mine if r not in text], text)


def _message(error: Exception, records: list[tuple[Site, str]]) -> Any:
    """The reasons of the sharding checks that failed the call, then jaxtyping's
    message; None when no sharding check did (a shape or dtype failure)."""
    text = str(error)
    if text.startswith(_RETURN):
        mine = [(s, r) for s, r in records if s.is_return]
    else:
        match = _PARAMETER.search(text)
        if match is None:
            return None
        mine = [
            (s, r) for s, r in records if s.argument == match[1] and not s.is_return
        ]
    return _prepend(mine, text)


def _prepend(mine: list[tuple[Site, str]], text: str) -> Any:
    lines: list[str] = []
    for site, reason in mine:
        line = f"{site.describe(location=False)}: {reason}"
        if line not in lines:
            lines.append(line)
    if not lines:
        return None
    return "\n".join(lines) + "\n" + text
