"""Turning compile-time (Auto axes) failures back into a plain TypeCheckError."""

import contextlib
import functools as ft
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.core import Tracer

from . import _mesh, _rules
from ._check import phase, pop_failure
from ._config import state


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
    underlying `jax.jit` object (with the checks).

    Speed: JAX marks `jax.debug.inspect_array_sharding` as a side effect, and a
    compiled function with one loses JAX's C++ dispatch fast path (about +0.1 ms
    a call on CPU). So for each new input signature (the shapes, dtypes and
    shardings of the array arguments, and the other arguments' values) this
    wrapper compiles the function twice: once with the checks, only to run them,
    and once without, to run it. Later calls with that signature (and the same
    mode, context mesh and axis rules) skip the checks and run at the speed of the
    unchecked function, plus a look-up of the signature. The wrapper remembers checked
    signatures for its lifetime (`jax.clear_caches()` does not reset it; make a
    new wrapper to check again). Called inside another trace (an outer `jit`,
    `grad`, `vmap`), it is plain `jax.jit` and its checks join the outer trace.

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
    return _Jitted(fun, jit_kwargs)


_UNHASHABLE = object()
_SIGNATURE_LIMIT = 1024


def _static_positions(fun: Callable, jit_kwargs: dict) -> tuple[frozenset, frozenset]:
    """The positions and names of `fun`'s static arguments, as `jax.jit` sees them."""
    raw_nums: Any = jit_kwargs.get("static_argnums", ()) or ()
    raw_names: Any = jit_kwargs.get("static_argnames", ()) or ()
    nums: set[int] = {raw_nums} if isinstance(raw_nums, int) else set(raw_nums)
    names: set[str] = {raw_names} if isinstance(raw_names, str) else set(raw_names)
    try:
        params = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        params = []
    nums = {n % len(params) if params and n < 0 else n for n in nums}
    for i, name in enumerate(params):  # jax.jit infers each from the other
        if i in nums:
            names.add(name)
        if name in names:
            nums.add(i)
    return frozenset(nums), frozenset(names)


def _leaf_key(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        return (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False), sharding)
    # Traced values that are not jax.Arrays (NumPy arrays, Python scalars):
    # their value does not change the compiled program, their type and shape do.
    return (type(leaf), getattr(leaf, "shape", None), getattr(leaf, "dtype", None))


def _signature(args: tuple, kwargs: dict, static: tuple) -> Any:
    """What a compiled executable depends on, over-approximated; hashable.

    `None` when an argument is a tracer: the call is inside another trace.
    """
    nums, names = static
    if not kwargs and not nums:
        # The common call, f(x, y, ...) on jax.Arrays, without flattening.
        # (Tracers have no `.sharding`, so they take the slow path.)
        try:
            return tuple([(a.shape, a.dtype, a.weak_type, a.sharding) for a in args])
        except AttributeError:
            pass
    if any(isinstance(x, Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
        return None
    key: list[Any] = [len(args), tuple(sorted(kwargs))]
    for i, arg in enumerate(args):
        key.append(("static", arg) if i in nums else _tree_key(arg))
    for name in sorted(kwargs):
        arg = kwargs[name]
        key.append(("static", arg) if name in names else _tree_key(arg))
    return tuple(key)


def _tree_key(tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, *map(_leaf_key, leaves))


class _Jitted:
    def __init__(self, fun: Callable, jit_kwargs: dict):
        # Two distinct Python functions, so that JAX's trace caches keep the
        # checked and the unchecked traces apart.
        checked = ft.wraps(fun)(lambda *args, **kwargs: fun(*args, **kwargs))
        unchecked = ft.wraps(fun)(lambda *args, **kwargs: fun(*args, **kwargs))
        self._jitted = jax.jit(checked, **jit_kwargs)
        self._unchecked = jax.jit(unchecked, **jit_kwargs)
        self._checked_signatures: set = set()
        self._static = _static_positions(fun, jit_kwargs)
        self.__wrapped__ = fun
        ft.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = _signature(args, kwargs, self._static)
        if signature is None:
            # Inside another trace (jit, grad, vmap): the checks join that trace
            # and run when the outer function compiles, with its shardings.
            return self._jitted(*args, **kwargs)
        mode = state.mode
        key = (mode, _mesh.context_mesh(), _rules.current(), signature)
        try:
            seen = key in self._checked_signatures
        except TypeError:  # an unhashable argument: check on every call
            seen, key = False, _UNHASHABLE
        # In mode "off" there is nothing to check: the checked twin is not even
        # traced, so JAX's trace cache never holds a version of it without checks.
        if not seen and mode != "off":
            # Lowering and compiling runs every check (trace time and compile
            # time) before anything runs.
            with sharding_errors():
                self._jitted.lower(*args, **kwargs).compile()
            if key is not _UNHASHABLE:
                if len(self._checked_signatures) >= _SIGNATURE_LIMIT:
                    self._checked_signatures.clear()
                self._checked_signatures.add(key)
        previous = phase.skip
        phase.skip = True
        try:
            return self._unchecked(*args, **kwargs)
        finally:
            phase.skip = previous

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return ft.partial(self, instance)

    def __repr__(self) -> str:
        return f"jaxtyping_shard.jit({self.__wrapped__!r})"
