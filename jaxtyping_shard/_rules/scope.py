"""Logical axis rules: which mesh axes each logical dim name is sharded over.

A rules table maps logical names (`batch`, `embed`, `mlp`) to mesh axes. It is
looked up when a value is checked, never when an annotation is written, so one
model runs under FSDP, tensor-parallel or both by swapping the table. The table in
force is scoped per thread and async context (`contextvars`), with a process-wide
default under it; it is mirrored into a `jax.make_user_context` so that JAX's
trace, lowering and compile caches are keyed on it too.

The table itself (`AxisRules`) is parsed in `table.py`; resolution
(`resolve`, in `_layout/resolve.py`) turns the logical names of one array's dims into
spec entries.
"""

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional, TypeVar

import jax
from jax._src.config import config_ext  # JAX-private: see `_mirror_into_jax`

from .._core import compat
from .._core.errors import ShardingAnnotationError
from .table import AxisRules, Conflicts, RulesLike


F = TypeVar("F", bound=Callable[..., Any])


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_scoped: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxtyping_shard_axis_rules", default=_UNSET
)
_default: list[Optional[AxisRules]] = [None]  # process-wide, under every scope
_default_lock = threading.Lock()

# JAX keys its trace, lowering and compile caches on user contexts: a function
# traced (and checked) under one rules table is traced again under another.
# JAX's value is thread-local, ours per context; they differ only while async
# tasks interleave different tables on one thread (see docs/logical.md).
_jax_key = jax.make_user_context(None)


def _mirror_into_jax() -> None:
    """Writes the scoped rules of this context into JAX's thread-local key.

    `jax.make_user_context` offers only a `with` block, which restores on exit the
    value it found on entry; when async tasks interleave on one thread, that value
    belongs to another task and would outlive every scope. So the value is written
    from our contextvar on each enter and exit, through the `Config` object behind
    the public `UserConfig` (`_obj`) and JAX's `unset` marker, both JAX-private
    (tested by test_axis_rules.py::test_async_tasks_have_their_own_rules).
    """
    value = _scoped.get()
    _jax_key._obj.set_local(config_ext.unset if value is _UNSET else value)


def current() -> Optional[AxisRules]:
    """The rules in force here: the innermost `axis_rules` scope, else the default."""
    value = _scoped.get()
    return _default[0] if value is _UNSET else value


def _coerce(rules: Any, conflicts: Optional[Conflicts]) -> Optional[AxisRules]:
    if rules is None:
        if conflicts is not None:
            raise ShardingAnnotationError(
                "conflicts= needs a rules table; `axis_rules(None)` means no rules."
            )
        return None
    if isinstance(rules, AxisRules) and conflicts is None:
        return rules
    return AxisRules(rules, conflicts=conflicts)


@contextlib.contextmanager
def axis_rules(
    rules: Optional[RulesLike],
    *,
    conflicts: Optional[Conflicts] = None,
) -> Iterator[Optional[AxisRules]]:
    """Sets the logical axis rules inside a `with` block (this thread / task only).

    Rules are read when a value is checked, so the same annotated model runs
    under any table; checks, `jaxtyping_shard.jit` and JAX's own trace caches all
    key on the table in force.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from jaxtyping import Array
        import jaxtyping_shard as jts
        from jaxtyping_shard import Float

        mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"),
                             axis_types=(AxisType.Explicit,) * 2)
        W = Float[Array, "embed mlp", jts.Logical]
        w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("fsdp", "tensor")))
        with jts.axis_rules({"embed": "fsdp", "mlp": "tensor"}):
            assert isinstance(w, W)
        ```

    **Arguments:**

    - `rules`: a dict `{logical_name: mesh_axes}`, a dataclass instance or
        NamedTuple with one field per logical name (the program's own rules), a
        list of `(logical_name, mesh_axes)` pairs (Flax's form: Linen's
        `nn.logical_axis_rules`, NNX's `nnx.logical_axis_rules`), an
        [`jaxtyping_shard.AxisRules`][], or `None` for no rules inside the
        block. See [Logical axes](logical.md).
    - `conflicts`: `"error"` (default), `"first"` or `"fallback"`: what happens
        when two dims of one array want the same mesh axis.

    **Returns:**

    A context manager; `with ... as rules` gives the parsed `AxisRules`.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] for a malformed table.
    """
    parsed = _coerce(rules, conflicts)
    token = _scoped.set(parsed)
    _mirror_into_jax()
    try:
        yield parsed
    finally:
        _scoped.reset(token)
        _mirror_into_jax()


class _DefaultSetter:
    """What `set_axis_rules` returns: already set; `with` restores the previous."""

    def __init__(self, previous: Optional[AxisRules]):
        self.previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
        _set_default(self.previous)

    def __repr__(self) -> str:
        return f"<jaxtyping_shard default axis rules {current()!r}>"


def _set_default(rules: Optional[AxisRules]) -> None:
    with _default_lock:
        _default[0] = rules
        compat.set_user_context_global(_jax_key, rules)


def set_axis_rules(
    rules: Optional[RulesLike],
    *,
    conflicts: Optional[Conflicts] = None,
) -> contextlib.AbstractContextManager[None]:
    """Sets the process-wide default logical axis rules (every thread).

    An `axis_rules` block overrides it for its thread or task.

    !!! Example

        ```python
        import jaxtyping_shard as jts

        jts.set_axis_rules({"batch": "data", "embed": "fsdp"})   # from now on
        with jts.set_axis_rules({"batch": "data", "embed": None}):  # for a block
            ...
        jts.set_axis_rules(None)                                  # no default
        ```

    **Arguments:** as for [`jaxtyping_shard.axis_rules`][]; `None` clears the
    default.

    **Returns:**

    An object that, used as a context manager, restores the previous default.
    """
    parsed = _coerce(rules, conflicts)
    with _default_lock:
        previous = _default[0]
    _set_default(parsed)
    return _DefaultSetter(previous)


def get_axis_rules() -> Optional[AxisRules]:
    """The logical axis rules in force here (`None` if none are set)."""
    return current()


def flax_rules(
    rules: Optional[RulesLike] = None,
) -> tuple[tuple[str, Any], ...]:
    """The rules as Flax NNX takes them: `(name, mesh_axes)` pairs for
    `nnx.logical_axis_rules`, so that Flax's own eager sharding and
    `nnx.eval_shape` resolve a module's metadata as these rules do.

    !!! Example

        ```python
        from flax import nnx
        import jaxtyping_shard as jts

        rules = {"embed": "data", "mlp": "model", "vocab": None}
        with jts.axis_rules(rules), nnx.logical_axis_rules(jts.flax_rules()):
            assert nnx.get_logical_axis_rules() == (
                ("embed", "data"), ("mlp", "model"), ("vocab", None))
        ```

    **Arguments:**

    - `rules`: a table (any form `axis_rules` takes); omitted: those in
        force here.

    **Returns:** a tuple of `(name, mesh axis | tuple of mesh axes | None)`.

    **Raises:** `ShardingAnnotationError` where Flax cannot say the same: no
    rules; a name with fallbacks (NNX keeps one rule per name, the last); a
    conflict policy other than `"error"` (NNX has none).
    """
    table = current() if rules is None else _coerce(rules, None)
    if table is None:
        raise ShardingAnnotationError(
            "flax_rules(): no axis rules in force and none given; pass a table or "
            "call it inside `jts.axis_rules(...)`."
        )
    several = [
        n
        for n in table.names()
        if len(table.candidates(n) or ()) > 1 and n not in table.gathered
    ]
    if several or table.conflicts != "error":
        why = (
            f"the name(s) {', '.join(map(repr, several))} have fallbacks"
            if several
            else f"conflicts={table.conflicts!r} is set"
        )
        raise ShardingAnnotationError(
            f"flax_rules(): {why} in {table.describe()}, which Flax NNX's "
            "`nnx.logical_axis_rules` cannot say (one rule per name, the last "
            "wins; no conflict policy). Give one mesh axis (or tuple, or None) "
            "per name."
        )
    # A `jts.fsdp` name gives Flax its mesh axes where stored (NNX shards the
    # parameters it creates by them); its implied fallback is not Flax's to say.
    return tuple(
        (name, None if not c else c[0] if len(c) == 1 else c)
        for name, c in table.pairs
        if name not in table.gathered or c
    )


# -- a per-call `axis_rules=` ----------------------------------------------------


@contextlib.contextmanager
def given(rules: Optional[RulesLike]) -> Iterator[None]:
    """A per-call `axis_rules=`: inside, exactly `with axis_rules(rules):` (the
    same scope, so JAX's caches key the same way); `None`: the rules in force."""
    if rules is None:
        yield
        return
    with axis_rules(rules):
        yield


def per_call(fn: F) -> F:
    """`fn`'s keyword `axis_rules=` (declared in its signature, taken here): the
    call runs under that table, as inside `with jts.axis_rules(table):`."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with given(kwargs.pop("axis_rules", None)):
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def per_call_step(fn: F) -> F:
    """`per_call` for a function whose first argument is a step: a step with
    rules of its own (`jts.jit(f, axis_rules=...)`) is run, traced and checked
    under those, inside the call's (as a nested `with` would be), by whatever
    `fn` does with it (`preflight` traces its function itself)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        own = None
        if args and isinstance(args[0], UnderRules):
            own, args = args[0]._jts_rules, (args[0]._jts_inner, *args[1:])
        with given(kwargs.pop("axis_rules", None)), given(own):
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def per_wrap(factory: F) -> F:
    """`jts.jit(f, axis_rules=...)`: the rules given when `f` is wrapped hold
    for every call of the result (see `UnderRules`); the table is parsed here,
    so a malformed one is refused when wrapping."""

    @functools.wraps(factory)
    def wrap(fun: Any = None, /, *, axis_rules: Any = None, **kwargs: Any) -> Any:
        if axis_rules is None:
            return factory(fun, **kwargs)
        table = _coerce(axis_rules, None)
        if fun is None:
            return functools.partial(wrap, axis_rules=table, **kwargs)
        with given(table):
            return UnderRules(factory(fun, **kwargs), table)

    return wrap  # type: ignore[return-value]


class UnderRules:
    """A jitted function whose every call, `.lower`, `.trace` and `.eval_shape`
    runs under one rules table, as inside `with jts.axis_rules(table):` (the
    same scope, so JAX's caches key on the table as under `with`). Every other
    attribute is the jitted function's."""

    _STAGES = ("lower", "trace", "eval_shape")

    def __init__(self, inner: Any, rules: Optional[AxisRules]) -> None:
        self._jts_inner, self._jts_rules = inner, rules
        functools.update_wrapper(self, inner, updated=())  # name, doc, __wrapped__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with given(self._jts_rules):
            return self._jts_inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_jts_"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        attr = getattr(self._jts_inner, name)
        if name not in self._STAGES:
            return attr
        rules = self._jts_rules

        @functools.wraps(attr)
        def staged(*args: Any, **kwargs: Any) -> Any:
            with given(rules):
                return attr(*args, **kwargs)

        return staged

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return UnderRules(self._jts_inner.__get__(instance, owner), self._jts_rules)

    def __repr__(self) -> str:
        return f"<{self._jts_inner!r} under axis rules {self._jts_rules!r}>"


def rules_text() -> str:
    """The axis rules in force as messages name them (`"none"` without any)."""
    rules = current()
    return "none" if rules is None else rules.describe()
