"""`jaxtyping_shard.jit` and `sharding_errors`, kept as names.

Compile-time (Auto axes) failures reach the caller of plain `jax.jit` as
`ShardingTypeCheckError` (see `_compile_check`), so neither needs to do anything.
"""

import contextlib
import functools as ft
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ..._rules.scope import per_wrap as _per_wrap
from . import boundary as _boundary, derive as _jit_shardings


@contextlib.contextmanager
def sharding_errors() -> Iterator[None]:
    """Kept for code written against 0.1.0: compile-time failures need no help now.

    A sharding mismatch found when XLA compiles a function (mesh axes of
    type `Auto`) now reaches the caller of plain `jax.jit` as a
    [`jaxtyping_shard.ShardingTypeCheckError`][] (a `jaxtyping.TypeCheckError`)
    listing every mismatch of that compile, rather than as a `JaxRuntimeError`.
    This context manager lets every exception through unchanged.

    !!! Example

        ```python
        with jaxtyping_shard.sharding_errors():
            out = jax.jit(step)(params, batch)
        ```
    """
    yield


@_per_wrap  # axis_rules=: every call of the result runs under that table
def jit(
    fun: Callable | None = None, /, *, axis_rules: Any = None, **jit_kwargs: Any
) -> Any:
    """`jax.jit`, plus a check of every annotated leaf of arguments and results.

    A checked function needs nothing more than `jax.jit`: the compile-time checks
    (meshes with `Auto` axes) raise [`jaxtyping_shard.ShardingTypeCheckError`][]
    from the call that compiles, listing every mismatch of that compile; they add
    no effect to the program, so JAX compiles each signature once and dispatches
    later calls through its C++ fast path; and the mode
    ([`jaxtyping_shard.set_mode`][]) is part of the key of JAX's caches, so a mode
    change takes effect at the next call.

    What it adds to `jax.jit`: every leaf inside the arguments and results whose
    annotation has a sharding is checked, from the parameter and return
    annotations (`list[Block]`, `dict[str, Float[...]]`) and from the field
    annotations of the dataclasses and Equinox modules inside them (a parameter
    annotated as one array is left to the function's own checker), with all
    mismatches in one error naming each leaf by key path (`model.blocks[1].w_in`).
    These checks run when JAX traces the function, once per new input signature,
    and leave nothing in the compiled program (see [Trees and modules](trees.md)).

    !!! Example

        ```python
        @jaxtyping_shard.jit
        @jaxtyped(typechecker=beartype)
        def f(x: Float[Array, "b e", P("data", None)]) -> Float[Array, "b e"]:
            return x * 2
        ```

    **Arguments:**

    - `fun`: the function to compile. May be omitted to use this as
        `@jaxtyping_shard.jit(static_argnums=...)`.
    - `**jit_kwargs`: passed to `jax.jit`, except that
        `in_shardings="annotations"` and `out_shardings="annotations"` derive
        `jit`'s shardings from `fun`'s annotations, and `reshard_inputs=True`
        moves committed arguments placed otherwise instead of raising a
        [`jaxtyping_shard.ShardingTypeCheckError`][] naming them (see
        [Input placement](placement.md)), and `stacked={pattern: n}` gives
        the leaves matching the pattern (in each argument and the result,
        paths relative to each) `n` extra leading dims before their
        annotation's, for the checks and the derived shardings, as
        [`jaxtyping_shard.sharded_init`][]'s `stacked=` (a field annotated
        `jts.Stacked[Block]` needs no pattern).
    - `axis_rules`: a logical axis rules table (any form
        [`jaxtyping_shard.axis_rules`][] takes) for every call of the result, and
        its `.lower`, `.trace` and `.eval_shape`: each runs as inside `with
        jts.axis_rules(axis_rules):`, a `with` block around it included (the
        table given here is the inner one). Given when wrapping, not per call (a
        keyword of the call is `fun`'s); per call, use the `with` block.

    **Returns:**

    The `jax.jit` object (with `"annotations"`: a wrapper that derives the
    shardings per call signature, mesh and rules, with `.lower`, `.trace` and
    `.eval_shape`; a call with the previous call's signature goes straight to
    JAX's C++ dispatch, as fast as plain `jax.jit`).
    """
    if fun is None:
        return ft.partial(jit, **jit_kwargs)
    stacked = jit_kwargs.get("stacked")
    # Every annotated leaf inside args and results.
    checked = _boundary.checked(fun, stacked=stacked)
    if _jit_shardings.uses_annotations(jit_kwargs):
        # in_shardings / out_shardings="annotations": derived from the signature.
        return _jit_shardings.AnnotatedJit(checked, jit_kwargs, jax.jit)
    return jax.jit(checked, **{k: v for k, v in jit_kwargs.items() if k != "stacked"})
