"""`check_tree`: every leaf of a tree against its annotation, one error for all."""

from collections.abc import Mapping
from typing import Any, Optional, TypeVar

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# jaxtyping binds dim names in the memo of the innermost `jaxtyped` call. A tree's
# leaves are checked each on its own (a `list[Block]` may hold blocks of different
# widths), so the memo stack is hidden while they are: read in this one place.
from jaxtyping._storage import _shape_storage

from .._core import mesh as _mesh, site as _site
from .._core.errors import ShardingAnnotationError, ShardingTypeCheckError
from .._core.failures import warn_at_user_line
from .._core.modes import current_mode
from .._layout import bridge as _bridge, spec as _spec
from .._layout.spec import has_sharding, sharded_members
from .._verdict.check import spec_check
from .._verdict.compare import FIX
from . import paths as _paths, walk as _tree
from .stacked import rank_mismatch, stacked_prefixes


T = TypeVar("T")


def check_tree(
    tree: T,
    annotations: Any = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    stacked: Optional[Mapping[str, Any]] = None,
    name: str = "tree",
) -> T:
    """Checks every leaf of a tree against its annotation; one error lists all.

    !!! Example

        ```python
        import dataclasses
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from jaxtyping import Array
        from jaxtyping_shard import Float

        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Dense:
            w: Float[Array, "embed mlp@model"]

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        params = Dense(jax.device_put(jnp.ones((4, 8)),
                                      NamedSharding(mesh, P(None, "model"))))
        jts.check_tree(params, name="params")           # passes
        grads = jax.tree.map(jnp.zeros_like, params)
        jts.check_tree(grads, like=params, name="grads")  # same shardings
        ```

    Works on concrete arrays, inside `jit` (Explicit axes at trace time, Auto
    axes when XLA compiles, reported through [`jaxtyping_shard.jit`][] or
    [`jaxtyping_shard.sharding_errors`][]), inside `shard_map`, and on
    `jax.ShapeDtypeStruct` leaves (from [`jaxtyping_shard.abstract`][] or
    `jax.eval_shape`: their dtype, dims and `sharding`; one without a sharding
    fails an annotation that asks for one). Each leaf is checked on its own: dim
    names bind within one leaf, not across leaves.

    **Arguments:**

    - `tree`: a pytree (dicts, lists, dataclasses, Equinox modules, ...).
    - `annotations`: as for [`jaxtyping_shard.shardings`][]: `None` (field
        annotations), a type hint, or a prefix tree of annotations,
        `PartitionSpec`s and `NamedSharding`s.
    - `rules`: path rules, as for [`jaxtyping_shard.shardings`][].
    - `like`: another tree (the parameters, say): each leaf of `tree` must be
        sharded as the leaf at the same key path of `like`, as `like`'s own
        annotations say or, where it has none, as it is actually sharded
        (concrete arrays, or Explicit axes inside `jit`). Only the sharding is
        compared. Not together with `annotations` or `rules`.
    - `stacked`: as for [`jaxtyping_shard.sharded_init`][]: `{pattern: n}` (or
        `{pattern: ('pipe',)}`) declares the extra leading dims of the leaves
        whose key path matches (layers stacked with `eqx.filter_vmap`). Those
        leaves are checked for their sharding (the declared leading entries, then
        their annotation's) and rank, not for dim names; a leaf whose rank
        cannot hold both is one mismatch among the others. With `like`, the
        pattern applies to `like`'s leaves, whose annotations describe one layer.
    - `name`: how the tree is named in messages: `params['layers'][0]['w_in']`.

    **Returns:**

    `tree`, unchanged.

    **Raises:**

    [`jaxtyping_shard.ShardingTypeCheckError`][] listing every mismatched leaf by
    key path, with expected and actual in JAX's notation and the mesh;
    [`jaxtyping_shard.ShardingAnnotationError`][] for malformed annotations or
    rules.
    """
    if like is not None:
        if annotations is not None or rules is not None:
            raise ValueError("check_tree: give `like` or annotations/rules, not both.")
        leaves, plan = _tree.plan_for(tree)
        checkers = _like_checkers(plan.paths, like, stacked)
    else:
        leaves, plan = _tree.plan_for(tree, annotations, rules)
        checkers = checkers_of(plan)
        if stacked:
            checkers = _stacked_checkers(leaves, plan, checkers, stacked, name)
    failures = leaf_failures(leaves, plan.paths, checkers, name)
    if failures:
        total = sum(c is not None for c in checkers)
        raise error(f"check_tree({name})", failures, total)
    return tree


def checkers_of(plan: Any, sharded_only: bool = False) -> tuple:
    """Per leaf, what to check it against (`None`: nothing), cached on the plan."""
    key = ("check_tree", sharded_only)
    try:
        return plan.cache[key]
    except KeyError:
        pass
    out = []
    for annotation in plan.annotations:
        if sharded_only and not has_sharding(annotation):
            out.append(None)
        elif isinstance(annotation, NamedSharding):
            out.append(spec_check(annotation.spec))
        elif isinstance(annotation, PartitionSpec):
            out.append(spec_check(annotation))
        else:
            out.append(annotation)
    checkers = tuple(out)
    plan.cache[key] = checkers
    return checkers


def leaf_failures(
    leaves: list,
    paths: tuple,
    checkers: tuple,
    name: str,
    function: Optional[str] = None,
    is_return: bool = False,
    name_sites: bool = True,
) -> list:
    """`[(path name, reason), ...]` for the leaves that fail their checkers.

    `name_sites=False` leaves compile-time checks to find their own site (under
    `jaxtyped`, the parameter and the key path inside it).
    """
    failures = []
    hidden = getattr(_shape_storage, "memo_stack", None)
    if hidden:
        _shape_storage.memo_stack = []
    try:
        for leaf, checker, path in zip(leaves, checkers, paths):
            if checker is None:
                continue
            if type(checker) is _Missing:
                reason = checker.reason
                if checker.layout and current_mode() != "check":
                    # A layout mismatch: warned (mode "warn") or not checked.
                    if current_mode() == "warn":
                        warn_at_user_line(f"{_paths.path_name(name, path)}: {reason}")
                    continue
            elif isinstance(leaf, Tracer) and not name_sites:
                reason = _reason(checker, leaf)
            elif isinstance(leaf, Tracer):
                # Compile-time (Auto) checks name the leaf by its key path.
                argument = None if is_return else name
                keys = jax.tree_util.keystr(path)
                with _site.naming(function, argument, is_return, keys):
                    reason = _reason(checker, leaf)
            elif isinstance(leaf, jax.ShapeDtypeStruct):
                reason = _reason(checker, leaf, _abstract_reason)
            elif isinstance(leaf, checker):
                continue
            else:
                reason = _reason(checker, leaf)
            if reason:
                failures.append((_paths.path_name(name, path), reason))
    finally:
        if hidden:
            _shape_storage.memo_stack = hidden
    return failures


def _reason(checker: Any, leaf: Any, one: Any = None) -> str:
    """Why `leaf` fails `checker` ("" if it passes): `one(annotation, leaf)`,
    by default the annotation's own `__instancecheck_str__`; a union passes if
    one of its members does."""
    check = one or (lambda annotation, value: annotation.__instancecheck_str__(value))
    members = sharded_members(checker) if not hasattr(checker, "_jts") else ()
    if members:
        reasons = [check(m, leaf) for m in members]
        return "" if "" in reasons else reasons[0]
    return check(checker, leaf)


def _abstract_reason(checker: Any, leaf: jax.ShapeDtypeStruct) -> str:
    """A `jax.ShapeDtypeStruct` (what `abstract` and `jax.eval_shape` give, what a
    checkpoint is restored into) against one annotation (see `_reason` for
    unions): its dtype and shape as jaxtyping checks an array's, then its
    `sharding` as a concrete array's."""
    dtype, dims = getattr(checker, "dtype", None), getattr(checker, "dim_str", None)
    if dtype is None or dims is None:  # not an array annotation
        return _reason(checker, leaf)
    twin = _abstract_twins.get(checker)
    if twin is None:
        twin = _abstract_twins[checker] = dtype[jax.ShapeDtypeStruct, dims]
    message = type(twin).__instancecheck_str__(twin, leaf)
    if message or not has_sharding(checker):
        return message
    if leaf.sharding is None:
        hint = getattr(getattr(checker, "_jts", None), "text", None) or checker.__name__
        shown = _spec.format_array(leaf.dtype, leaf.shape, ())
        return (
            f"this `jax.ShapeDtypeStruct` ({shown}) has no sharding, and its type "
            f"hint {hint} asks for one. Give it `sharding=` (`jts.abstract` does), "
            "or check the arrays themselves."
        )
    return checker._jts_sharding_str(leaf)  # the sharding part of the check


# Per annotation, jaxtyping's dtype-and-dims check of a `jax.ShapeDtypeStruct`.
_abstract_twins: dict = {}


def error(what: str, failures: list, total: int) -> ShardingTypeCheckError:
    """One error for all the failed leaves, the fix said once."""
    lines = []
    fix = ""
    for path, reason in failures:
        if reason.endswith(FIX):
            reason = reason[: -len(FIX)].rstrip()
            fix = FIX
        lines.append(f"  {path}: {reason}")
    count = len(failures)
    head = (
        f"{what}: {count} of {total} checked leaves do not match their annotation"
        f"{'s' if count > 1 else ''}:"
    )
    return ShardingTypeCheckError("\n".join([head, *lines, *([fix] if fix else [])]))


class _Missing:
    """A failure known before any check: a leaf of `tree` with no counterpart in
    `like` (always), or a stacked leaf whose rank cannot hold its layout
    (`layout=True`: a sharding mismatch, as the mode says)."""

    def __init__(self, reason: str, layout: bool = False):
        self.reason = reason
        self.layout = layout


def _stacked_checkers(
    leaves: list, plan: Any, checkers: tuple, stacked: Mapping[str, Any], name: str
) -> tuple:
    """The checkers of leaves with declared leading dims: the declared entries,
    then the spec of their annotation for the remaining dims."""
    leads = stacked_prefixes(plan.paths, stacked)
    out = list(checkers)
    for i, (leaf, lead) in enumerate(zip(leaves, leads)):
        if lead and out[i] is not None:
            where = _paths.path_name(name, plan.paths[i])
            out[i] = _with_lead(leaf, out[i], lead, where)
    return tuple(out)


def _with_lead(leaf: Any, annotation: Any, lead: tuple, where: str) -> Any:
    wrong = rank_mismatch(leaf, annotation, lead)
    if wrong:
        return _Missing(wrong, layout=True)
    spec = _stacked_spec(leaf, annotation, lead, where)
    return spec_check(spec)


def _stacked_spec(leaf: Any, annotation: Any, lead: tuple, where: str) -> PartitionSpec:
    shape = tuple(getattr(leaf, "shape", ()))
    rest = shape[len(lead) :]
    if not has_sharding(annotation):
        return PartitionSpec(*lead, *([None] * len(rest)))
    spec = _resolved_spec(leaf, annotation, rest, where)
    entries = tuple(spec) + (None,) * (len(rest) - len(spec))
    return PartitionSpec(*lead, *entries)


def _like_checkers(paths: tuple, like: Any, stacked: Any = None) -> tuple:
    like_leaves, like_plan = _tree.plan_for(like)
    leads = stacked_prefixes(like_plan.paths, stacked)
    by_path = {
        tuple(map(_paths.key_id, p)): (leaf, annotation, p, lead)
        for leaf, annotation, p, lead in zip(
            like_leaves, like_plan.annotations, like_plan.paths, leads
        )
    }
    out: list[Any] = []
    for path in paths:
        found = by_path.get(tuple(map(_paths.key_id, path)))
        if found is None:
            out.append(
                _Missing(
                    f"`like` has no leaf at {jax.tree_util.keystr(path)} (its "
                    f"structure differs: {like_plan.treedef})"
                )
            )
            continue
        leaf, annotation, like_path, lead = found
        if lead and has_sharding(annotation):
            wrong = rank_mismatch(leaf, annotation, lead)
            if wrong:
                out.append(_Missing(f"`like` leaf of {wrong}", layout=True))
                continue
            where = "like" + jax.tree_util.keystr(like_path)
            spec = _stacked_spec(leaf, annotation, lead, where)
            out.append(spec_check(spec))
        else:
            out.append(spec_check(_like_spec(leaf, annotation, like_path)))
    return tuple(out)


def _resolved_spec(
    leaf: Any, annotation: Any, dims: tuple, where: str
) -> PartitionSpec:
    """A sharded annotation's spec for `dims` (the leaf's shape after any stacked
    dims), resolved as a check of that leaf would: with the shape (fallback lists
    skip candidates that do not divide) and the leaf's mesh; inside shard_map the
    shape is a local one, so by rank only."""
    mesh = _leaf_mesh(leaf)
    manual = mesh is not None and AxisType.Manual in mesh.axis_types
    known = None if manual and isinstance(leaf, Tracer) else dims
    return _bridge.spec_for(annotation, len(dims), where, shape=known, mesh=mesh)


def _like_spec(leaf: Any, annotation: Any, path: tuple) -> PartitionSpec:
    shape = tuple(getattr(leaf, "shape", ()))
    where = "like" + jax.tree_util.keystr(path)
    if has_sharding(annotation):
        return _resolved_spec(leaf, annotation, shape, where)
    if isinstance(leaf, Tracer):
        aval = jax.typeof(leaf)
        mesh = _mesh.of_aval(aval)
        if mesh is None:
            return PartitionSpec()
        unknown = [
            n
            for n, t, s in zip(mesh.axis_names, mesh.axis_types, mesh.axis_sizes)
            if t != AxisType.Explicit and s > 1
        ]
        if unknown:
            raise ShardingAnnotationError(
                f"check_tree(like=...): {where} has no annotation, and inside this "
                f"trace its sharding over the non-Explicit mesh axes {unknown} is "
                "not known until XLA compiles. Annotate it (field annotations, "
                "`annotations=` or `rules=` on a check of `like` itself), or check "
                "against concrete arrays."
            )
        return aval.sharding.spec
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if sharding is None or len(sharding.device_set) == 1:
        return PartitionSpec()
    raise ShardingAnnotationError(
        f"check_tree(like=...): {where} is sharded as {sharding}, which names no "
        "mesh axes to compare with. Place it with a NamedSharding."
    )


def _leaf_mesh(leaf: Any) -> Any:
    """The mesh a leaf of `like` lives on: its own, its type's, or the context's."""
    if isinstance(leaf, Tracer):
        return _mesh.of_aval(jax.typeof(leaf))
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return mesh if mesh is not None and not mesh.empty else _mesh.context_mesh()
