"""`jaxtyping_shard.filter_jit`: `eqx.filter_jit` with `jts.jit`'s boundary checks
and, on request, its shardings derived from annotations.

Without `in_shardings` / `out_shardings` it is `eqx.filter_jit` of the checked
function (`boundary.checked`): Equinox splits every argument into its arrays
(traced) and everything else (static, part of the cache key) exactly as it
always does, and the checks run on the whole arguments when the function is
traced. With `"annotations"` the split is done here, as Equinox does it (a leaf
is traced when it is an array: `jax.Array`, `np.ndarray`, `np.generic`), and
`derive.AnnotatedJit` is given a function whose parameters are the original
ones, holding only the arrays (the other leaves `None`), plus one static
parameter in front holding the rest; its hints are the original ones, so the
derived shardings, the refusal of a committed argument placed otherwise and the
messages name the original parameters and key paths. The result is split the
same way: its arrays come out of `jit`, the rest travels as a leafless pytree.
On Auto axes the split function is told, per entry, the shardings `jit` gives
its arrays (`split._jts_placed`, as the boundary's): the boundary lays them on
the traced leaves of the whole arguments, and decides those checks at trace
time.

Equinox stays optional: importing this module does not import it.
"""

import dataclasses
import functools as ft
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..._rules.scope import per_wrap as _per_wrap
from ..._trees.signature import read
from . import boundary as _boundary, derive as _derive


_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")
_STATIC = "_jts_static"
_ACCEPTED = ("in_shardings", "out_shardings", "reshard_inputs")


@_per_wrap  # axis_rules=: every call of the result runs under that table
def filter_jit(
    fun: Callable | None = None,
    /,
    *,
    donate: str = "none",
    axis_rules: Any = None,
    **jit_kwargs: Any,
) -> Any:
    """`eqx.filter_jit`, plus `jaxtyping_shard.jit`'s checks and shardings.

    Arrays anywhere in the arguments are traced and every other leaf is static,
    as `eqx.filter_jit` does it, so stock `eqx.nn` layers (`eqx.nn.Linear`,
    `eqx.nn.MLP` with its activation functions), static fields, Python numbers
    and strings pass through unchanged. Every annotated leaf of the arguments
    and the result is checked by key path when the function is traced, as
    [`jaxtyping_shard.jit`][] checks it: on an `Explicit` mesh at trace time,
    on an `Auto` mesh when XLA compiles. The checks follow the mode
    ([`jaxtyping_shard.set_mode`][]) and leave nothing in the compiled program.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts

        mlp = eqx.nn.MLP(4, 2, width_size=8, depth=1, key=jax.random.key(0))

        @jts.filter_jit
        def apply(model, x):
            return jax.vmap(model)(x)

        out = apply(mlp, jnp.ones((3, 4)))
        ```

    **Arguments:**

    - `fun`: the function to compile. May be omitted to use this as
        `@jaxtyping_shard.filter_jit(donate=...)`.
    - `donate`: as `eqx.filter_jit`'s: `"none"` (the default), `"all"`,
        `"all-except-first"`, `"warn"` or `"warn-except-first"`.
    - `in_shardings="annotations"`, `out_shardings="annotations"`,
        `reshard_inputs=True`, `stacked=`: as for [`jaxtyping_shard.jit`][],
        applied to the array leaves (keyword-only and `*args` parameters are
        not donated).
    - `axis_rules`: as for [`jaxtyping_shard.jit`][]: for every call.

    **Returns:**

    The compiled function (`eqx.filter_jit`'s object; with `"annotations"`, a
    wrapper that derives the shardings per call signature, with `.lower` and
    `.eval_shape`, which take `jax.ShapeDtypeStruct`s for arrays).

    **Raises:**

    `ImportError` if Equinox is not installed (`pip install
    jaxtyping-shard[equinox]`); `ValueError` for another `donate` or a
    `jax.jit` keyword `eqx.filter_jit` does not take.
    """
    if fun is None:
        return ft.partial(filter_jit, donate=donate, **jit_kwargs)
    if donate not in _DONATE:
        raise ValueError(
            f"filter_jit(donate={donate!r}): expected one of {', '.join(_DONATE)} "
            "(as eqx.filter_jit)."
        )
    try:
        # Equinox is an optional dependency: imported only once filter_jit is used.
        import equinox as eqx
    except ImportError as error:
        raise ImportError(
            "jaxtyping_shard.filter_jit needs Equinox: `pip install "
            "jaxtyping-shard[equinox]` (or use jaxtyping_shard.jit)."
        ) from error

    stacked = jit_kwargs.pop("stacked", None)
    checked = _boundary.checked(fun, "jaxtyping_shard.filter_jit", stacked)
    others = [k for k in jit_kwargs if k not in _ACCEPTED]
    if others or not (_derive.uses_annotations(jit_kwargs) or not jit_kwargs):
        raise ValueError(
            f"filter_jit({', '.join(others or jit_kwargs)}=...): eqx.filter_jit "
            "takes no jax.jit keyword arguments (every non-array leaf is static "
            "already); the only ones accepted here are in_shardings='annotations', "
            "out_shardings='annotations', reshard_inputs=True and stacked=."
        )
    if not jit_kwargs:
        return eqx.filter_jit(checked, donate=donate)
    split = _split_function(fun, checked)
    kwargs = dict(jit_kwargs, static_argnums=(0,), stacked=stacked)
    donated = _donated(fun, donate)
    if donated:
        kwargs["donate_argnums"] = donated
    quiet = donate in ("all", "all-except-first")
    return _FilterJit(_derive.AnnotatedJit(split, kwargs, jax.jit), fun, quiet)


def is_array(leaf: Any) -> bool:
    """What `eqx.filter_jit` traces (`eqx.is_array`)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class _Static:
    """The non-array leaves of some arguments: hashable, a static argument."""

    treedef: Any
    leaves: tuple


@jax.tree_util.register_pytree_node_class
class _Out:
    """The non-array part of a result: a pytree with no leaves."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def tree_flatten(self) -> tuple:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value: Any, children: Any) -> "_Out":
        return cls(value)


def _partition(tree: Any, abstract: bool = False) -> tuple[Any, _Static]:
    """`(tree with only its arrays, the rest)`, as `eqx.partition(tree, is_array)`
    (with `abstract`, a `jax.ShapeDtypeStruct` counts as an array: `lower`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    traced = [
        is_array(leaf) or (abstract and isinstance(leaf, jax.ShapeDtypeStruct))
        for leaf in leaves
    ]
    dynamic = [leaf if t else None for leaf, t in zip(leaves, traced)]
    static = tuple(None if t else leaf for leaf, t in zip(leaves, traced))
    return jax.tree_util.tree_unflatten(treedef, dynamic), _Static(treedef, static)


def _combine(dynamic: Any, static: _Static) -> Any:
    leaves = jax.tree_util.tree_leaves(dynamic, is_leaf=lambda x: x is None)
    merged = [s if d is None else d for d, s in zip(leaves, static.leaves)]
    return jax.tree_util.tree_unflatten(static.treedef, merged)


def _split_function(fun: Callable, checked: Callable) -> Callable:
    """`split(static, *args, **kwargs)`: `fun`'s parameters holding arrays only."""
    original = read(fun)
    parameters = original.parameters
    if parameters is None:
        raise TypeError(
            f"filter_jit({original.name}, in_shardings='annotations'): its "
            "signature cannot be read, so no shardings can be derived from it."
        )

    # jax.jit names its static arguments: none may be positional-only (a call
    # passes every one positionally anyway).
    either = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(_STATIC, either)] + [
        p.replace(
            annotation=inspect.Parameter.empty,
            kind=either if p.kind is inspect.Parameter.POSITIONAL_ONLY else p.kind,
        )
        for p in parameters.parameters.values()
    ]
    hints = dict(original.hints)
    if "return" in hints:
        hints["return"] = tuple[hints["return"], Any]

    def make(checked: Callable) -> Callable:
        def split(static: _Static, *args: Any, **kwargs: Any) -> tuple:
            args, kwargs = _combine((args, kwargs), static)
            out = checked(*args, **kwargs)  # every annotated leaf, by key path
            dynamic, rest = _partition(out)
            return dynamic, _Out(rest)

        split.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        split.__annotations__ = hints
        split.__qualname__ = split.__name__ = original.name
        split.__module__ = __name__
        # As the boundary's: the same function told the shardings `jit` gives
        # its leaves (per parameter, the arrays only: the boundary, which sees
        # the whole arguments, lays them on their traced leaves).
        variant = getattr(checked, "_jts_placed", None)
        if variant is not None:
            split._jts_placed = lambda placed: make(variant(placed))  # type: ignore[attr-defined]
        return split

    return make(checked)


def _donated(fun: Callable, donate: str) -> tuple:
    """The positions (after the static one in front) of the parameters `donate`
    gives up: positional ones, not `*args` or keyword-only ones."""
    if donate == "none":
        return ()
    parameters = read(fun).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    values = parameters.parameters.values() if parameters else ()
    count = 0
    for p in values:
        if p.kind not in kinds:
            break
        count += 1
    first = 2 if donate.endswith("except-first") else 1
    return tuple(range(first, count + 1))


class _FilterJit:
    """Splits each call's arguments as `eqx.filter_jit` does and joins the result."""

    def __init__(
        self, jitted: _derive.AnnotatedJit, fun: Callable, quiet: bool
    ) -> None:
        self._jitted, self._quiet = jitted, quiet
        self.__wrapped__ = fun
        ft.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        (args, kwargs), static = _partition((args, kwargs))
        if self._quiet:
            # donate="all": as eqx.filter_jit, without JAX's warning about the
            # donated buffers no output could reuse.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Some donated buffers were not")
                dynamic, rest = self._jitted(static, *args, **kwargs)
        else:
            dynamic, rest = self._jitted(static, *args, **kwargs)
        return _combine(dynamic, rest.value)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower` with the derived shardings; arrays may be given
        as `jax.ShapeDtypeStruct`s."""
        (args, kwargs), static = _partition((args, kwargs), abstract=True)
        return self._jitted.lower(static, *args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The result as `jax.ShapeDtypeStruct`s (with the derived shardings),
        its non-array leaves as they are; nothing runs."""
        (args, kwargs), static = _partition((args, kwargs), abstract=True)
        dynamic, rest = self._jitted.eval_shape(static, *args, **kwargs)
        return _combine(dynamic, rest.value)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else ft.partial(self, instance)

    def __repr__(self) -> str:
        fun = self.__wrapped__
        return f"jaxtyping_shard.filter_jit({fun!r}, shardings from annotations)"
