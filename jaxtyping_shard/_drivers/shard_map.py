"""`typed_shard_map`: `jax.shard_map` with specs read from the annotations."""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError, ShardingTypeCheckError
from .._layout import bridge as _bridge
from .._layout.spec import has_sharding, only_axes
from .._trees import hints as _hints, signature as _signature, walk as _tree
from .jit.arguments import mismatch


def _is_tree_hint(annotation: Any) -> bool:
    """A hint for a pytree (a class, `dict[str, A]`, `list[Block]`): specs per leaf."""
    if annotation is inspect.Parameter.empty or annotation is None:
        return False
    if has_sharding(annotation) or _hints.leaf_annotation(annotation):
        return False
    return isinstance(annotation, type) or typing.get_origin(annotation) is not None


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
    # A return's spec: logical annotations resolve with the rules in force at
    # the call, by rank (see `_out_specs`).
    spec = _bridge.spec_for(annotation, shape, mesh, "typed_shard_map")
    return _restrict(spec, axis_names)


def _restrict(spec: PartitionSpec, axis_names: Optional[frozenset]) -> PartitionSpec:
    if axis_names is None:
        return spec
    # With a subset of manual axes, the specs name only those; the other axes
    # stay Auto/Explicit and the annotation is still checked against them inside.
    return only_axes(spec, axis_names)


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
    body. A return annotated `tuple[A, B]` gives a tuple of out_specs. Pytree
    parameters and returns take their specs leaf by leaf, as
    [`jaxtyping_shard.shardings`][] reads them: a parameter annotated with a
    dataclass or Equinox module class whose fields are sharded annotations, or
    with `dict[str, A]`, `list[Block]`, `tuple[A, Model]`. For a pytree return,
    the output's structure is found by tracing the body once more, abstractly.

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
    variadic (`*args`, `**kwargs`); at the call, naming the key path, when a leaf
    of a pytree parameter or return has none.
    """
    if fn is None:
        return ft.partial(
            typed_shard_map, mesh=mesh, axis_names=axis_names, check_vma=check_vma
        )
    name = getattr(fn, "__qualname__", repr(fn))
    signature = inspect.signature(fn)
    read = _signature.read(fn)  # each hint on its own: say which cannot be read
    if read.unread:
        raise ShardingAnnotationError(
            f"typed_shard_map({name}): {next(iter(read.unread.values()))}, and "
            "shard_map needs a spec from each annotation. Make the names it uses "
            "exist at run time (not only under `TYPE_CHECKING`)."
        )
    hints = read.hints
    in_annotations = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): parameter {param.name!r} is variadic; "
                "shard_map needs one spec per argument, so list them."
            )
        annotation = hints.get(param.name, param.annotation)
        if _is_tree_hint(annotation):  # specs per leaf, at the call
            in_annotations.append(_TreeHint(annotation))
            continue
        in_annotations.append(
            _annotation_of(annotation, f"parameter {param.name!r}", name)
        )
    ret = hints.get("return", signature.return_annotation)
    tree_return = _is_tree_hint(ret) and not (
        typing.get_origin(ret) is tuple
        and all(has_sharding(a) for a in typing.get_args(ret))
    )
    if tree_return:
        outs: Any = _TreeHint(ret)
    elif typing.get_origin(ret) is tuple:
        outs = tuple(
            _annotation_of(a, f"return element {i}", name)
            for i, a in enumerate(typing.get_args(ret))
        )
    else:
        outs = _annotation_of(ret, "the return value", name)
    for out in outs if isinstance(outs, tuple) else () if tree_return else (outs,):
        if getattr(out._jts, "suffix", None) or getattr(out._jts, "variadic", False):
            raise ShardingAnnotationError(
                f"typed_shard_map({name}): the return annotation {out._jts.text} "
                "shards dims after a variadic dim, so its rank (and out_specs) is "
                "unknown before the call. Write the return's dims out."
            )
    manual = None if axis_names is None else frozenset(axis_names)

    def tree_specs(
        value: Any, hint: Any, what: str, where: Any, wrong: Any = None, arg: str = ""
    ) -> Any:
        """Specs per leaf; with `wrong`, the misplaced committed leaves of the
        argument `arg` are added to it, by path."""
        leaves, plan = _tree.plan_for(value, hint)
        specs = []
        for leaf, annotation, path in zip(leaves, plan.annotations, plan.paths):
            at = f"typed_shard_map({name}): {what}{jax.tree_util.keystr(path)}"
            if not has_sharding(annotation):
                raise ShardingAnnotationError(
                    f"{at} has no sharded annotation, so shard_map has no spec for "
                    "it. Annotate the field with a sharding (`@()` or `P()` for "
                    "replicated)."
                )
            shape = tuple(jax.typeof(leaf).shape)
            spec = _bridge.spec_for(annotation, shape, where, at)
            if wrong is not None:
                at = arg + jax.tree_util.keystr(path)
                _misplaced(leaf, spec, where, at, wrong)
            specs.append(_restrict(spec, manual))
        return jax.tree_util.tree_unflatten(plan.treedef, specs)

    @ft.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # shard_map takes positional arguments only; keywords are bound to them.
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
        where = mesh if mesh is not None else _mesh.concrete_context_mesh()
        wrong: list = []  # committed arguments shard_map would move silently
        in_specs = []
        for annotation, a, p in zip(in_annotations, args, signature.parameters):
            if isinstance(annotation, _TreeHint):
                what = f"parameter {p!r}"
                specs = tree_specs(a, annotation.hint, what, where, wrong, p)
                in_specs.append(specs)
                continue
            shape = tuple(jax.typeof(a).shape)
            spec = _bridge.spec_for(annotation, shape, where, "typed_shard_map")
            _misplaced(a, spec, where, p, wrong)
            in_specs.append(_restrict(spec, manual))
        if wrong:
            raise ShardingTypeCheckError(
                f"typed_shard_map({name}): {len(wrong)} argument"
                f"{'s are' if len(wrong) > 1 else ' is'} placed otherwise than "
                "annotated, and shard_map would move "
                f"{'them' if len(wrong) > 1 else 'it'} silently:\n"
                + "\n".join(f"  - {w}" for w in wrong)
                + "\nPlace the data as annotated (`jts.place`, `jts.reshard`)."
            )

        def mapped(out_specs: Any, check: bool) -> Any:
            return jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=tuple(in_specs),
                out_specs=out_specs,
                axis_names=manual or frozenset(),
                check_vma=check,
            )

        if tree_return:
            # Trace once, abstractly, for the output's structure (its ranks are
            # right with any out_specs: P() with check_vma=False).
            abstract = jax.eval_shape(mapped(PartitionSpec(), False), *args)
            out_specs = tree_specs(abstract, ret, "the return value", where)
        else:
            out_specs = _out_specs(outs, where, manual)
        return mapped(out_specs, check_vma)(*args)

    # Its entry checks no traced argument: shard_map lays each out by its
    # in_spec (on Auto axes, silently), and the body's checks see local shards
    # laid out so. The `jts.jit` boundary checks its arguments itself (see
    # `jit.boundary.checks_own_entry`).
    wrapped._jts_unchecked_entry = wrapped  # type: ignore[attr-defined]
    return wrapped


def _misplaced(
    value: Any, spec: PartitionSpec, mesh: Any, name: str, wrong: list
) -> None:
    """Adds to `wrong` a committed array whose sharding is not `spec` on the
    mesh (`is_equivalent_to`, devices included). On Auto axes shard_map would
    reshard it without a word; on Explicit ones JAX's error does not name it.
    Traced values are laid out by the trace (their checks are the body's)."""
    if isinstance(value, Tracer) or not isinstance(value, jax.Array):
        return
    if not isinstance(mesh, jax.sharding.Mesh):  # no devices known: its own
        mesh = getattr(value.sharding, "mesh", None)
    if not value.committed or not isinstance(mesh, jax.sharding.Mesh):
        return
    target = NamedSharding(mesh, spec)
    if not value.sharding.is_equivalent_to(target, value.ndim):
        wrong.append(mismatch(name, value, target))


def _out_specs(outs: Any, mesh: Any, manual: Optional[frozenset]) -> Any:
    # The global shape of a result is its local shape times the out_spec's axes,
    # so it cannot choose among fallback candidates: resolved by rank, as a check
    # inside the body resolves a value that is not an argument (`None`: the rank
    # the dim string fixes; a variadic return was refused when decorated).
    if isinstance(outs, tuple):
        return tuple(_spec(out, None, mesh, manual) for out in outs)
    return _spec(outs, None, mesh, manual)


class _TreeHint:
    """A parameter or return annotated as a pytree: specs read per leaf."""

    def __init__(self, hint: Any):
        self.hint = hint
