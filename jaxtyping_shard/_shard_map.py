"""`typed_shard_map`: `jax.shard_map` with specs read from the annotations."""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec

from . import _logical, _mesh
from ._errors import ShardingAnnotationError


def _annotation_of(annotation: Any, what: str, fn_name: str) -> Any:
    """The sharded annotation (its `_jts` is the layout, physical or logical)."""
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
    return annotation


def _spec(
    annotation: Any, shape: Any, mesh: Any, axis_names: Optional[frozenset]
) -> PartitionSpec:
    # Logical annotations resolve with the rules in force at the call.
    entries = _logical.resolve(annotation._jts, shape, mesh, where=annotation.__name__)
    spec = PartitionSpec(*(e[0] if len(e) == 1 else e or None for e in entries))
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
    in_annotations = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): parameter {param.name!r} is variadic; "
                "shard_map needs one spec per argument, so list them."
            )
        annotation = hints.get(param.name, param.annotation)
        in_annotations.append(
            _annotation_of(annotation, f"parameter {param.name!r}", name)
        )
    ret = hints.get("return", signature.return_annotation)
    if typing.get_origin(ret) is tuple:
        outs: Any = tuple(
            _annotation_of(a, f"return element {i}", name)
            for i, a in enumerate(typing.get_args(ret))
        )
    else:
        outs = _annotation_of(ret, "the return value", name)
    for out in outs if isinstance(outs, tuple) else (outs,):
        if getattr(out._jts, "suffix", None) or getattr(out._jts, "variadic", False):
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): the return annotation {out._jts.text} "
                "shards dims after a variadic dim, so its rank (and out_specs) is "
                "unknown before the call. Write the return's dims out."
            )
    manual = None if axis_names is None else frozenset(axis_names)

    @ft.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # shard_map takes positional arguments only; keywords are bound to them.
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
        where = mesh if mesh is not None else _mesh.context_mesh()
        in_specs = tuple(
            _spec(annotation, tuple(jax.typeof(a).shape), where, manual)
            for annotation, a in zip(in_annotations, args)
        )
        out_specs = _out_specs(outs, where, manual)
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


def _out_specs(outs: Any, mesh: Any, manual: Optional[frozenset]) -> Any:
    # Output shapes are not known before the call: resolved by rank.
    if isinstance(outs, tuple):
        return tuple(_spec(out, out._jts.min_rank, mesh, manual) for out in outs)
    return _spec(outs, outs._jts.min_rank, mesh, manual)
