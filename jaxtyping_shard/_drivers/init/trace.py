"""`fn` as `sharded_init` traces it: array inputs in, array leaves out.

`Traced` wraps `fn(*args, **kwargs)` as a function of its array inputs (PRNG keys
included; the other arguments are static) returning only its array leaves, and
rebuilds the whole tree from them. It also collects the compile-time checks that
`fn` schedules (a `@jaxtyped` module's `__init__`): those of values `fn` returns
run on the concrete result instead (`run_deferred`). `abstract_shapes` traces it
with no data.
"""

import warnings
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from ..._core import compat
from ..._core.errors import ShardingTypeCheckError, ShardingWarning
from ..._verdict import auto as _compile_check


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
    )


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_abstract_or_dynamic(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or _is_dynamic(x)


def _split(tree: Any, keep: Callable[[Any], bool]) -> tuple[list, list, Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dynamic = [x if keep(x) else None for x in leaves]
    static = [None if keep(x) else x for x in leaves]
    return dynamic, static, treedef


def _merge(dynamic: list, static: list, treedef: Any) -> Any:
    leaves = [s if d is None else d for d, s in zip(dynamic, static)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Traced:
    """`fn` as a function of its array inputs only, returning array leaves only."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, abstract: bool = False):
        self.fn = fn
        # JAX names the compiled module (and compile-time errors name it) after this.
        self.__name__ = f"sharded_init_{getattr(fn, '__name__', 'fn')}"
        # For `abstract` (nothing runs), a `jax.ShapeDtypeStruct` argument is an
        # input too, traced as its shape and dtype: `opt.init` of abstract
        # parameters sees arrays (not the struct, nor its mesh's axis types).
        dynamic = _is_abstract_or_dynamic if abstract else _is_dynamic
        self.inputs, self.in_static, self.in_treedef = _split((args, kwargs), dynamic)
        self.out_static: Optional[list] = None
        self.out_treedef: Any = None
        # Compile-time checks of values that `fn` returns: (output index, cls,
        # site), run on the concrete result instead (see `_defer_checks`).
        self.deferred: list = []

    def __call__(self, inputs: list) -> list:
        args, kwargs = _merge(inputs, self.in_static, self.in_treedef)
        previous = _compile_check.watching.checks
        collected: list = []
        _compile_check.watching.checks = collected
        try:
            out = self.fn(*args, **kwargs)
        finally:
            _compile_check.watching.checks = previous
        arrays, self.out_static, self.out_treedef = _split(out, is_array)
        arrays = [x for x in arrays if x is not None]
        self.deferred = _defer_checks(collected, arrays)
        return arrays

    def rebuild(self, arrays: list) -> Any:
        assert self.out_static is not None
        it = iter(arrays)
        dynamic = [next(it) if s is None else None for s in self.out_static]
        return _merge(dynamic, self.out_static, self.out_treedef)


def _defer_checks(collected: list, outputs: list) -> list:
    """The compile-time checks of values `fn` returns, moved onto the result.

    A check of a value that `fn` returns (a module's field, as its generated
    `__init__` receives it) is a check of the result: it runs on the concrete
    array, whose layout is the annotated one. Checked inside the compile, XLA may
    report another layout for the same value (a constant it copies per user),
    which would be a false alarm. Checks of intermediates stay compile-time.
    """
    where = {id(x): i for i, x in enumerate(outputs)}
    deferred = []
    for obj, check in collected:
        if id(obj) in where:
            check.on_result = True
            deferred.append((where[id(obj)], check))
    return deferred


def run_deferred(traced: Traced, arrays: list, tree: Any) -> None:
    if not traced.deferred:
        return
    paths = [p for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_array(x)]
    failures: dict = {}
    for index, check in traced.deferred:
        mismatch = check.mismatch(arrays[index].sharding, ())
        if mismatch is None or check.mode == "off":
            continue
        text = (
            f"{mismatch.replace('XLA sharded it', 'it is sharded', 1)}; created as "
            f"output{jax.tree_util.keystr(paths[index])}"
        )
        if check.mode == "warn":
            warnings.warn(text, ShardingWarning, stacklevel=4)
        else:
            failures.setdefault(text)  # jaxtyped re-checks arguments
    if failures:
        raise ShardingTypeCheckError(
            "sharded_init: checks in the function, run on its result:\n  "
            + "\n  ".join(failures)
        )


def _all_auto(mesh: Any) -> Any:
    kinds = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, AbstractMesh) or not compat.top_level():
        # Inside a trace only an abstract mesh may be put in context.
        return AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=kinds)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=kinds)


def abstract_shapes(traced: Traced, mesh: Any) -> Any:
    """The output tree with `jax.ShapeDtypeStruct` array leaves (no shardings);
    `mesh` a `Mesh` or an `AbstractMesh`."""
    # Inputs without shardings: a key made under another `jax.set_mesh` would
    # carry that mesh into a trace under this one.
    inputs = [
        None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x in traced.inputs
    ]
    with compat.mesh_scope(_all_auto(mesh)):
        shapes = jax.eval_shape(traced, inputs)
    return traced.rebuild(shapes)
