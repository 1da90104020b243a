"""`typed_shard_map`: `jax.shard_map` with specs read from the annotations."""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec

from ._errors import ShardingAnnotationError


def _layout_of(annotation: Any, what: str, fn_name: str) -> Any:
    layout = getattr(annotation, "_jts", None)
    if layout is None:
        if annotation is inspect.Parameter.empty:
            problem = "has no annotation"
        else:
            problem = f"is annotated {annotation!r}, which has no sharding"
        raise ShardingAnnotationError(
            f"typed_shard_map({fn_name}): {what} {problem}. Every parameter and the "
            "return value need a sharded annotation, e.g. "
            '`Float[Array, "batch embed", P("data", None)]` or '
            '`Float[Array, "batch@data embed"]`, from which in_specs / out_specs '
            "are read."
        )
    return layout


def _spec(layout: Any, ndim: int, axis_names: Optional[frozenset]) -> PartitionSpec:
    spec = layout.spec(ndim)
    if axis_names is None:
        return spec
    # With a subset of manual axes, the specs name only those; the other axes
    # stay Auto/Explicit and the annotation is still checked against them inside.
    kept = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        names = tuple(n for n in names if n in axis_names)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*kept)


def typed_shard_map(
    fn: Optional[Callable] = None,
    /,
    *,
    mesh: Any = None,
    axis_names: Optional[set] = None,
    check_vma: bool = True,
) -> Any:
    """`jax.shard_map`, with `in_specs` and `out_specs` read from the annotations.

    Each parameter and the return value must be annotated with a sharding; the
    annotation describes the *global* array, exactly as it is checked inside the
    body. A return annotated `tuple[A, B]` gives a tuple of out_specs.

    !!! Example

        ```python
        @typed_shard_map(mesh=mesh)
        @jaxtyped(typechecker=beartype)          # optional: also check inside
        def col(x: Float[Array, "b d", P("data", None)],
                w: Float[Array, "d f", P(None, "model")],
                ) -> Float[Array, "b f", P("data", "model")]:
            return x @ w
        ```

    **Arguments:**

    - `fn`: the body. May be omitted to use `typed_shard_map(mesh=...)` as a
        decorator.
    - `mesh`: the mesh; `None` uses the context mesh (`jax.set_mesh`).
    - `axis_names`: the manual axes (default: all). Specs keep only these axes.
    - `check_vma`: passed to `jax.shard_map`.

    **Returns:**

    The wrapped function, called with global arrays.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] at decoration time when a
    parameter or the return value has no sharded annotation, or a parameter is
    variadic (`*args`, `**kwargs`).
    """
    if fn is None:
        return ft.partial(
            typed_shard_map, mesh=mesh, axis_names=axis_names, check_vma=check_vma
        )
    name = getattr(fn, "__qualname__", repr(fn))
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolvable forward references: use what is there
        hints = {}
    in_layouts = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): parameter {param.name!r} is variadic; "
                "shard_map needs one spec per argument, so list them."
            )
        annotation = hints.get(param.name, param.annotation)
        in_layouts.append(_layout_of(annotation, f"parameter {param.name!r}", name))
    ret = hints.get("return", signature.return_annotation)
    if typing.get_origin(ret) is tuple:
        out_layouts: Any = tuple(
            _layout_of(a, f"return element {i}", name)
            for i, a in enumerate(typing.get_args(ret))
        )
    else:
        out_layouts = _layout_of(ret, "the return value", name)
    for layout in out_layouts if isinstance(out_layouts, tuple) else (out_layouts,):
        if layout.suffix:
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): the return annotation {layout.text} "
                "shards dims after a variadic dim, so its rank (and out_specs) is "
                "unknown before the call. Write the return's dims out."
            )
    manual = None if axis_names is None else frozenset(axis_names)
    out_specs = _out_specs(out_layouts, manual)

    @ft.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # shard_map takes positional arguments only; keywords are bound to them.
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
        in_specs = tuple(
            _spec(layout, len(jax.typeof(a).shape), manual)
            for layout, a in zip(in_layouts, args)
        )
        mapped = jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=manual or frozenset(),
            check_vma=check_vma,
        )
        return mapped(*args)

    return wrapped


def _out_specs(layouts: Any, manual: Optional[frozenset]) -> Any:
    if isinstance(layouts, tuple):
        return tuple(_spec(layout, layout.min_rank, manual) for layout in layouts)
    return _spec(layouts, layouts.min_rank, manual)
