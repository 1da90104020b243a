"""`shardings(tree)`: the tree of `NamedSharding`s that a tree's annotations ask for."""

from collections.abc import Mapping
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding

from .._layout import bridge as _bridge
from .._layout.spec import has_sharding
from .._rules.scope import per_call as _per_call
from .._trees import like as _like, walk as _tree


@_per_call  # axis_rules=: the call runs under that table
def shardings(
    tree: Any,
    mesh: Any = None,
    *,
    annotations: Any = None,
    rules: Optional[Mapping[str, Any]] = None,
    stacked: Optional[Mapping[str, Any]] = None,
    like: Any = None,
    axis_rules: Any = None,
) -> Any:
    """The `NamedSharding` of every annotated leaf of a tree, read off annotations.

    !!! Example

        ```python
        import dataclasses
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts
        from jax.sharding import AxisType, PartitionSpec as P
        from jaxtyping import Array
        from jaxtyping_shard import Float

        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Dense:
            w: Float[Array, "embed mlp", P(None, "model")]
            b: Float[Array, "mlp@model"]

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        init = lambda: Dense(jnp.zeros((4, 8)), jnp.zeros(8))
        abstract = jax.eval_shape(init)
        params = jax.jit(init, out_shardings=jts.shardings(abstract, mesh))()
        assert params.w.sharding.spec == P(None, "model")
        ```

    **Arguments:**

    - `tree`: a pytree of arrays, or of `jax.ShapeDtypeStruct`s (the abstract tree
        from `jax.eval_shape` / `eqx.filter_eval_shape`), holding dataclasses or
        Equinox modules whose fields are annotated, plain containers, or both.
    - `mesh`: the mesh of the shardings. Omitted: the context mesh
        (`jax.set_mesh`); a leaf annotated with a `NamedSharding` keeps its own.
        A `jax.sharding.AbstractMesh` of any size gives shardings on it (for
        `jax.ShapeDtypeStruct`s, as `jax.jit(...).trace` takes them).
    - `annotations`: annotations for leaves the fields do not annotate: a type
        hint (`dict[str, Float[Array, "e m", P("data")]]`) or a tree that is a
        prefix of `tree`, whose leaves are annotations, `PartitionSpec`s,
        `NamedSharding`s or `None`. See [Trees and modules](trees.md).
    - `rules`: a mapping from a path pattern (`"blocks/*/mlp/weight"`, `"**/bias"`)
        to an annotation, `PartitionSpec`, `NamedSharding` or `None`. Strict: a
        rule matching no leaf, or a leaf matched by two, is an error.
    - `stacked`: as for [`jaxtyping_shard.sharded_init`][]: `{pattern: n}` (or
        `{pattern: ("pipe",)}`) gives the matching leaves `n` extra leading
        dims, replicated (or sharded as given), before their annotation's
        (layers stacked with `eqx.filter_vmap`). A field annotated
        `jts.Stacked[Block]` declares it without this.
    - `like`: another tree (the parameters): the shardings follow it by
        [`jaxtyping_shard.check_tree`][]'s `like=` rule. A tree with `like`'s
        structure: each leaf as `like`'s leaf at its path. An optimiser state
        (`opt.init(params)`): each subtree with the parameters' structure (the
        moments) as the parameters, its leaves of another shape (adafactor's
        factored statistics) and every other leaf (counts) replicated. `like`'s
        annotations count, or where it has none its arrays' shardings. Omitted
        `mesh`: `like`'s. Not together with `annotations` or `rules`.
    - `axis_rules`: the logical axis rules for this call, as inside `with
        jts.axis_rules(axis_rules):` (any form it takes); omitted: those in force.

    **Returns:**

    A tree of the same structure with a `jax.sharding.NamedSharding` for every
    leaf whose annotation has a sharding and `None` for the others, usable as
    `jax.jit(out_shardings=...)`, `jax.device_put` and
    `jax.make_array_from_process_local_data` targets.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] for a malformed annotation tree
    or rule, an annotation naming a mesh axis the mesh lacks (the message names
    the leaf), or field annotations that cannot be resolved.
    """
    if like is not None:
        if annotations is not None or rules is not None:
            raise ValueError("shardings: give `like` or annotations/rules, not both.")
        return _like_shardings(tree, mesh, like, stacked)
    leaves, plan = _tree.plan_for(tree, annotations, rules, stacked)
    _tree.refuse_problems(leaves, plan, "shardings")
    if mesh is None and any(
        has_sharding(a) and not isinstance(a, NamedSharding) for a in plan.annotations
    ):
        mesh = _bridge.resolve_mesh(None, "shardings")
    out = [
        sharding_for_leaf(leaf, annotation, mesh, path)
        for leaf, annotation, path in zip(leaves, plan.annotations, plan.paths)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def _like_shardings(tree: Any, mesh: Any, like: Any, stacked: Any) -> Any:
    leaves, plan = _tree.plan_for(tree)
    what = "shardings(like=...)"
    # `stacked=` applies to `like`'s leaves, as for `check_tree(like=...)`.
    like_plan = _tree.like_plan_for(like, tree, stacked)
    specs = _like.like_specs(tree, leaves, plan, like_plan, what)
    if mesh is None:
        mesh = _like.like_mesh(like) or _bridge.resolve_mesh(None, "shardings")
    out = [
        None if getattr(leaf, "shape", None) is None else NamedSharding(mesh, spec)
        for leaf, spec in zip(leaves, specs)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def sharding_for_leaf(
    leaf: Any, annotation: Any, mesh: Any, path: tuple
) -> Optional[NamedSharding]:
    """The sharding one leaf's annotation asks for, or `None` if it has none."""
    if not has_sharding(annotation):
        return None
    if isinstance(annotation, NamedSharding) and mesh is None:
        return annotation
    where = "tree" + jax.tree_util.keystr(path)
    shape = tuple(getattr(leaf, "shape", ()))
    spec = _bridge.spec_for(annotation, shape, mesh, where)
    return _bridge.named_sharding(spec, mesh, annotation, where)
