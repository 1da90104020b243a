"""`check_tree`: every leaf of a tree against its annotation, one error for all."""

from collections.abc import Mapping
from typing import Any, Literal, Optional, overload, TypeVar

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._layout import bridge as _bridge, given as _given, spec as _spec
from .._layout.spec import has_sharding, Lead
from .._rules.scope import per_call as _per_call
from .._verdict.check import sharding_check, spec_check
from .._verdict.inputs import of_value
from . import leaves as _leaves, paths as _paths, silent as _silent, walk as _tree
from .like import like_layout
from .stacked import rank_mismatch


T = TypeVar("T")


@overload
def check_tree(
    tree: T,
    annotations: Any = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    stacked: Optional[Mapping[str, Any]] = None,
    name: str = "tree",
    strict: bool = False,
    may_check_nothing: bool = False,
    summary: Literal[False] = False,
    axis_rules: Any = None,
) -> T: ...


@overload
def check_tree(
    tree: Any,
    annotations: Any = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    stacked: Optional[Mapping[str, Any]] = None,
    name: str = "tree",
    strict: bool = False,
    may_check_nothing: bool = False,
    summary: Literal[True],
    axis_rules: Any = None,
) -> _leaves.TreeSummary: ...


@_per_call  # axis_rules=: the call runs under that table
def check_tree(
    tree: Any,
    annotations: Any = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    stacked: Optional[Mapping[str, Any]] = None,
    name: str = "tree",
    strict: bool = False,
    may_check_nothing: bool = False,
    summary: bool = False,
    axis_rules: Any = None,
) -> Any:
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
        compared. Not together with `annotations` or `rules`. A tree without
        `like`'s key paths (an optimiser state) follows `like` in each subtree
        holding its structure (an `optax.MaskedNode` may stand for any part of
        it; one array: every array leaf), every other leaf replicated.
    - `stacked`: as for [`jaxtyping_shard.sharded_init`][]: `{pattern: n}` (or
        `{pattern: ('pipe',)}`) declares the extra leading dims of the leaves
        whose key path matches (layers stacked with `eqx.filter_vmap`). Those
        leaves are checked for their sharding (the declared leading entries, then
        their annotation's) and rank, not for dim names; a leaf whose rank
        cannot hold both is one mismatch among the others. With `like`, the
        pattern applies to `like`'s leaves, whose annotations describe one layer.
    - `name`: how the tree is named in messages: `params['layers'][0]['w_in']`.
    - `strict`: `True`: every array leaf must declare a sharding; each that does
        not (no annotation, one without a sharding, or under a hint that cannot
        be read) is a failure, named by key path.
    - `may_check_nothing`: `True`: a tree with array leaves none of which is
        checked passes (a bare optax state, a third party's tree: expected to
        declare nothing). By default that is an error, naming the leaves and
        why none declares anything (no annotation, or one that cannot be read):
        a check that checked nothing is not a pass.
    - `summary`: `True`: return a [`jaxtyping_shard.TreeSummary`][] (how many
        leaves were checked, which array leaves declare no sharding) instead of
        the tree.
    - `axis_rules`: the logical axis rules for this call, as inside `with
        jts.axis_rules(axis_rules):` (any form it takes); omitted: those in force.

    **Returns:**

    `tree`, unchanged (so `x = check_tree(x)` works); with `summary=True`, a
    [`jaxtyping_shard.TreeSummary`][] (`.tree` is the tree).

    **Raises:**

    [`jaxtyping_shard.ShardingTypeCheckError`][] listing every mismatched leaf by
    key path, with expected and actual in JAX's notation and the mesh, every
    node whose type hint does not fit it (a `tuple[A, B]` holding three
    elements, a dict missing a required key of its `TypedDict`), every
    dataclass JAX sees as one leaf because it is not registered as a pytree
    (its arrays would go unchecked), and with `strict=True` every array leaf
    that declares no sharding; and, unless `may_check_nothing=True`, a tree
    that has array leaves but checks none of them. Its first line counts the
    checked and the unannotated leaves; `error.summary` is the `TreeSummary`.
    [`jaxtyping_shard.ShardingAnnotationError`][] for malformed annotations or
    rules.
    """
    if like is not None:
        if annotations is not None or rules is not None:
            raise ValueError("check_tree: give `like` or annotations/rules, not both.")
        leaves, plan = _tree.plan_for(tree)
        checkers = _like_checkers(plan.paths, like, stacked, tree, leaves)
    else:
        leaves, plan = _tree.plan_for(tree, annotations, rules, stacked)
        checkers = checkers_of(plan)
    counts = _leaves.Counts()
    counts.add(name, leaves, plan, checkers)
    failures = _leaves.leaf_failures(leaves, plan.paths, checkers, name)
    failures += _silent.context_failures(
        leaves, plan.paths, checkers, name, failures, _leaves.Missing
    )
    structure = [
        (_paths.path_name(name, path), reason)
        for path, reason in _tree.problems(leaves, plan)
    ]
    if failures or structure or (strict and counts.unannotated):
        found = _leaves.error(
            f"check_tree({name})", failures, counts, structure, strict
        )
        found.summary = counts.summary(tree)  # type: ignore[attr-defined]
        raise found
    if counts.unannotated and not counts.checked and not may_check_nothing:
        _silent.refuse_nothing_checked(f"check_tree({name})", counts, tree)
    if summary:
        return counts.summary(tree)
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
            out.append(sharding_check(annotation))  # its devices too
        elif isinstance(annotation, PartitionSpec):
            out.append(spec_check(annotation))
        elif isinstance(annotation, Lead):
            out.append(LeadCheck(annotation))  # a stacked leaf, checked by shape
        else:
            out.append(annotation)
    checkers = tuple(out)
    plan.cache[key] = checkers
    return checkers


def _like_checkers(
    paths: tuple,
    like: Any,
    stacked: Any = None,
    tree: Any = None,
    leaves: Optional[list] = None,
) -> tuple:
    # `stacked=` applies to `like`'s leaves, whose annotations describe one layer.
    return like_checkers(
        like_layout(paths, _tree.like_plan_for(like, tree, stacked), tree, leaves)
    )


def like_checkers(sources: list) -> tuple:
    """The checkers of `like_layout`'s sources (one per leaf)."""
    out: list[Any] = []
    for source in sources:
        if source.spec is None and not source.missing:
            out.append(None)  # not known in this trace: unchecked
        elif source.spec is None:
            out.append(_leaves.Missing(source.missing, layout=source.layout))
        elif source.leaf is None:
            out.append(spec_check(source.spec))
        else:
            out.append(_like_check(source.leaf, source.spec))
    return tuple(out)


def _like_check(leaf: Any, spec: PartitionSpec) -> Any:
    """What a leaf of `tree` must match: `spec` on the devices (and in the memory)
    of a concrete `like` leaf, compared with `is_equivalent_to`; on the value's
    own mesh for a traced or abstract one, which knows no devices."""
    sharding = None if isinstance(leaf, Tracer) else getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        if isinstance(sharding.mesh, jax.sharding.Mesh):
            target = NamedSharding(
                sharding.mesh, spec, memory_kind=sharding.memory_kind
            )
            return sharding_check(target)
    elif sharding is not None and len(sharding.device_set) == 1:
        if not _spec.axes_of(_spec.entries_of(spec)):
            return sharding_check(sharding, spec)  # on one device: that one
    return spec_check(spec)


class LeadCheck(_leaves.RankFirst):
    """What the tree checks check a stacked leaf against: its declared leading
    entries, then its layer's spec for the dims after them, resolved per value
    as a check resolves (`of_value`), compared as a spec (`spec_check`).
    `leaves.leaf_failures` asks `_jts_rank_reason` first (a rank mismatch is a
    layout mismatch, reported as the mode says)."""

    _jts_stacked = True  # counted as checked (`leaves._bare`)

    def __init__(self, lead: Lead):
        self.lead = lead
        self.__name__ = self.__qualname__ = _given.describe(lead)

    def __instancecheck__(self, obj: Any) -> bool:
        return self.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(self, obj: Any) -> str:
        wrong = self._jts_rank_reason(obj)
        if wrong:
            return wrong
        shape, mesh = of_value(obj)
        spec = _bridge.spec_for(self.lead, shape, mesh)
        check = spec_check(spec)
        if isinstance(obj, jax.ShapeDtypeStruct) and obj.sharding is not None:
            return check._jts_sharding_str(obj)
        return check.__instancecheck_str__(obj)

    def _jts_rank_reason(self, obj: Any) -> str:
        """Why `obj`'s rank cannot hold the declared stack and its layer ("" if
        it can), saying how to declare the stack it has."""
        wrong = rank_mismatch(obj, self.lead.inner, self.lead.lead)
        if wrong:
            rank = len(getattr(obj, "shape", ()))
            fixed = _given.fixed_rank(self.lead)
            extra = rank - fixed if fixed is not None and rank > fixed else 0
            hint = (
                _given.stack_hint(extra + len(self.lead.lead)).replace(
                    "declare its", "declare all its"
                )
                if extra
                else " Check the stack declared (`stacked=` or `jts.Stacked[...]`)."
            )
            return f"{wrong}.{hint}"
        return ""
