"""Turning compile-time (Auto axes) failures back into a plain TypeCheckError."""

import contextlib
import functools as ft
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._check import pop_failure


_MARKER_RE = re.compile(r"\[jaxtyping_shard #(\d+)\]")


def _translate(error: BaseException) -> BaseException:
    match = _MARKER_RE.search(str(error))
    if match is None:
        return error
    failure = pop_failure(int(match.group(1)))
    return error if failure is None else failure


@contextlib.contextmanager
def sharding_errors() -> Iterator[None]:
    """Re-raises compile-time sharding failures as `ShardingTypeCheckError`.

    With `Auto` mesh axes the sharding is checked when XLA compiles, inside a
    `jax.debug.inspect_array_sharding` callback; JAX reports an exception raised
    there as `JaxRuntimeError: INTERNAL: ...`. Inside this block such an error
    becomes the original [`jaxtyping_shard.ShardingTypeCheckError`][], a subclass of
    `jaxtyping.TypeCheckError`.

    !!! Example

        ```python
        with jaxtyping_shard.sharding_errors():
            out = jax.jit(step)(params, batch)
        ```

    **Raises:**

    [`jaxtyping_shard.ShardingTypeCheckError`][] in place of the `JaxRuntimeError`
    that carried it; every other exception passes through unchanged.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        translated = _translate(error)
        if translated is error:
            raise
        raise translated from None


def jit(fun: Callable | None = None, /, **jit_kwargs: Any) -> Any:
    """`jax.jit`, with compile-time sharding failures raised as type-check errors.

    Takes the same arguments as `jax.jit` and returns a function that behaves the
    same, except that a sharding mismatch found when XLA compiles (meshes with
    `Auto` axes) is raised as [`jaxtyping_shard.ShardingTypeCheckError`][] (a
    `jaxtyping.TypeCheckError`) rather than `JaxRuntimeError: INTERNAL: ...`.
    `.lower`, `.trace`, `.eval_shape` and other attributes are those of the
    underlying `jax.jit` object.

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
    - `**jit_kwargs`: passed to `jax.jit`.

    **Returns:**

    The wrapped function.
    """
    if fun is None:
        return ft.partial(jit, **jit_kwargs)
    return _Jitted(jax.jit(fun, **jit_kwargs))


class _Jitted:
    __slots__ = ("_jitted", "__wrapped__", "__dict__")

    def __init__(self, jitted: Any):
        self._jitted = jitted
        self.__wrapped__ = jitted
        ft.update_wrapper(self, jitted)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._jitted(*args, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            translated = _translate(error)
            if translated is error:
                raise
            raise translated from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return ft.partial(self, instance)

    def __repr__(self) -> str:
        return f"jaxtyping_shard.jit({self._jitted!r})"
