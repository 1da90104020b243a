"""`jaxtyping_shard.nnx_jit`: `flax.nnx.jit` with `jts.jit`'s boundary checks,
and the graph nodes checked again after the step's in-place updates.

`nnx.jit` merges its graph-node arguments (modules, `nnx.Optimizer`, an
`nnx.State`) inside its trace, runs the step on them, and writes the Variables
the step updated back into the caller's objects. The function given to
`nnx.jit` here is the step checked at its boundary (`boundary.checked`: every
annotated leaf of every argument, a Variable's `out_sharding` metadata read as
its annotation by the tree walk, and the result by its hint), followed by the
same check of each argument holding NNX Variables on the values the step left
in them: still inside the trace, before `nnx.jit` writes them back. On Explicit
axes the updated values' types decide it at trace time; on Auto axes a
sharding constraint the step put on them is read at trace time too, and the
rest is left to the compile-time checks (`_verdict/auto.py`), as for `jts.jit`.

For `preflight` (which traces with `jax.jit`, on abstract arguments), the step
is given as a pure function (`NnxJit._jts_pure`): the same checked step, which
returns its result with every argument holding Variables after the update, so
that the updated state is counted (and its bytes) as outputs. Flax 0.12's
modules and optimizers are pytrees, so `jax.jit` carries them as such.

Flax stays optional: importing this module does not import it.
"""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any

import jax

from ..._core.modes import current_mode
from ..._rules.scope import per_wrap as _per_wrap
from ..._trees import leaves as _leaves, nnx as _nnx, silent as _silent
from ..._trees.signature import read
from ..._trees.stacked import lenient
from . import boundary as _boundary


_WHAT = "jaxtyping_shard.nnx_jit"
AFTER = "after the step's in-place updates"
AFTER_LABEL = "after its in-place updates"


@_per_wrap  # axis_rules=: every call of the result runs under that table
def nnx_jit(
    fun: Callable | None = None, /, *, axis_rules: Any = None, **jit_kwargs: Any
) -> Any:
    """`flax.nnx.jit`, plus a check of every annotated leaf of the graph nodes it
    is given, on entry and again after the step's in-place updates.

    The graph nodes (an `nnx.Module`, an `nnx.Optimizer` with its optimiser
    state, an `nnx.State`, any argument holding NNX Variables) are checked by
    key path against their Variables' `out_sharding` metadata (what
    `nnx.with_partitioning` writes; an optimiser's moments carry their
    parameter's) and their field annotations, when the step is traced: on
    entry, and again on the values the step left in them (after
    `optimizer.update(model, grads)`), before `nnx.jit` writes them back. The
    other arguments and the result are checked by the step's annotations, as
    [`jaxtyping_shard.jit`][] checks them. On `Explicit` mesh axes every check
    is decided at trace time; on `Auto` axes, the ones only XLA decides run
    when it compiles. The checks follow the mode
    ([`jaxtyping_shard.set_mode`][]) and leave nothing in the compiled program.

    !!! Example

        ```python
        import optax
        from flax import nnx
        import jaxtyping_shard as jts

        @jts.nnx_jit(donate_argnums=(0, 1))
        def train_step(model, optimizer, x, y):
            def loss_fn(model):
                return ((model(x) - y) ** 2).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss
        ```

    **Arguments:**

    - `fun`: the step. May be omitted to use this as
        `@jaxtyping_shard.nnx_jit(donate_argnums=...)`.
    - `may_check_nothing`: `True` accepts graph nodes none of whose array
        leaves declares a layout (no `out_sharding` metadata, no field
        annotation); by default such a step is refused, naming the leaves, as
        [`jaxtyping_shard.check_tree`][] refuses a tree it checks nothing of.
    - `**jit_kwargs`: passed to `nnx.jit` unchanged (`donate_argnums`,
        `donate_argnames`, `static_argnums`, `static_argnames`,
        `in_shardings`, `out_shardings`, `keep_unused`, ...), except
        `stacked=`, as for [`jaxtyping_shard.jit`][].
    - `axis_rules`: as for [`jaxtyping_shard.jit`][]: for every call, `.lower`,
        `.trace` and `.eval_shape`.

    **Returns:**

    The compiled step: called as `nnx.jit`'s, with `.lower`, `.trace` and
    `.eval_shape`; [`jaxtyping_shard.preflight`][] and
    [`jaxtyping_shard.collectives`][] take it with the graph nodes.

    **Raises:**

    `ImportError` if Flax is not installed (`pip install
    jaxtyping-shard[flax]`); `ValueError` for `in_shardings` or `out_shardings`
    `"annotations"` (the Variables are where they were placed: place them with
    [`jaxtyping_shard.sharded_init`][] or [`jaxtyping_shard.place`][]).
    """
    if fun is None:
        return ft.partial(nnx_jit, **jit_kwargs)
    try:
        # Flax is an optional dependency: imported only once nnx_jit is used.
        from flax import nnx
    except ImportError as error:
        raise ImportError(
            "jaxtyping_shard.nnx_jit needs Flax: `pip install "
            "jaxtyping-shard[flax]` (or use jaxtyping_shard.jit)."
        ) from error
    for key in ("in_shardings", "out_shardings"):
        if isinstance(jit_kwargs.get(key), str):
            raise ValueError(
                f"nnx_jit({key}={jit_kwargs[key]!r}): nnx.jit takes shardings, not "
                "'annotations': the graph nodes' Variables stay where they were "
                "placed (place them with jts.sharded_init or jts.place), and "
                "nnx_jit checks them there."
            )
    stacked = jit_kwargs.pop("stacked", None)
    nothing = bool(jit_kwargs.pop("may_check_nothing", False))
    step = checked_step(fun, stacked, nothing)
    return NnxJit(nnx.jit(step, **jit_kwargs), fun, step, jit_kwargs)


def checked_step(
    fun: Callable, stacked: Any = None, may_check_nothing: bool = False
) -> Callable:
    """`fun` checked at its boundary, and then each argument holding NNX
    Variables checked again on the values `fun` left in it; graph nodes whose
    array leaves none is checked are refused (unless `may_check_nothing`)."""
    checked = _boundary.checked(fun, _WHAT, stacked)
    lenient_stacked = lenient(stacked)
    info: list = []  # the signature, read at the first call

    @ft.wraps(fun)
    def step(*args: Any, **kwargs: Any) -> Any:
        out = checked(*args, **kwargs)  # entry, the step, its result
        if current_mode() == "off":
            return out
        if not info:
            info.append(read(fun))
        signature = info[0]
        where = f"{_WHAT}({signature.name}), {AFTER}"
        # What a failure found at compile time (Auto axes), or collected by
        # `preflight`, names: "argument `model.w.value` of `step, after ...`".
        label = f"{signature.name}, {AFTER_LABEL}"
        failures: list = []
        structure: list = []
        counts = _leaves.Counts()
        arguments = signature.arguments(args, kwargs)
        # A `jts.Like["model"]` lays its leaves out as the updated model's.
        likes = _boundary._likes(signature, arguments, where)
        for param, value, hint in arguments:
            if holds_variables(value):
                _boundary._failures(
                    value, hint, param, label, lenient_stacked, counts,
                    failures, structure, likes,
                )  # fmt: skip
        if failures or structure:
            raise _leaves.error(where, failures, counts, structure)
        if counts.unannotated and not counts.checked and not may_check_nothing:
            # Graph nodes none of whose Variables declares a layout (no
            # `out_sharding` metadata, no field annotation): not a pass.
            nodes = [v for _, v, _ in arguments]
            what = f"{_WHAT}({signature.name}), its graph nodes"
            _silent.refuse_nothing_checked(what, counts, nodes)
        return out

    step._jts_boundary = True  # type: ignore[attr-defined]
    return step


def holds_variables(value: Any) -> bool:
    """Whether `value` holds an NNX Variable (a graph node `nnx.jit` updates)."""
    nodes = jax.tree_util.tree_leaves(value, is_leaf=_nnx.is_variable)
    return any(_nnx.is_variable(node) for node in nodes)


class NnxJit:
    """`nnx.jit` of the checked step, its stages, and the step as a pure
    function for `preflight`."""

    def __init__(
        self, jitted: Any, fun: Callable, step: Callable, jit_kwargs: dict
    ) -> None:
        self._jitted, self._step, self._kwargs = jitted, step, jit_kwargs
        ft.update_wrapper(self, fun)  # name, doc, __wrapped__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`nnx.jit(...).lower`: every check runs in its trace."""
        return self._jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.eval_shape(*args, **kwargs)

    def _jts_pure(self) -> Callable:
        """The checked step as a pure function of pytrees (`preflight`): it
        returns `{"return": its result, parameter: the argument after the
        update}` for each argument holding Variables. Its parameters and their
        hints are the step's; its result has no hint (the step's own is
        checked inside)."""
        step = self._step
        original = read(self.__wrapped__)  # type: ignore[attr-defined]

        def pure(*args: Any, **kwargs: Any) -> dict:
            out = step(*args, **kwargs)
            updated = {"return": out}
            for param, value, _ in original.arguments(args, kwargs):
                if holds_variables(value):
                    updated[param] = value
            return updated

        if original.parameters is not None:
            pure.__signature__ = original.parameters.replace(  # type: ignore[attr-defined]
                return_annotation=inspect.Signature.empty
            )
        pure.__annotations__ = {
            k: v for k, v in original.hints.items() if k != "return"
        }
        pure.__qualname__ = pure.__name__ = original.name
        pure._jts_boundary = True  # type: ignore[attr-defined]
        return pure

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else ft.partial(self, instance)

    def __repr__(self) -> str:
        return f"jaxtyping_shard.nnx_jit({self.__wrapped__!r})"  # type: ignore[attr-defined]
