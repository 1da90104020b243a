"""What `sharded_init` will create, decided before anything is compiled.

From the abstract output tree (shapes and dtypes, no data) and the one tree walk
(`_trees.walk.plan_for`), one `NamedSharding` per array leaf, through the bridge
(`_layout.bridge.spec_for`, `named_sharding`). Every leaf that cannot be laid
out as annotated (a dim its mesh axes do not divide, an axis the mesh lacks, a
rank the annotation contradicts) is collected, and all of them are reported in
one error, by key path, with the padded size that would fix a dim.
"""

from collections.abc import Mapping
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..._core import mesh as _mesh
from ..._core.errors import ShardingAnnotationError
from ..._layout import bridge as _bridge, given as _given, spec as _spec
from ..._layout.bridge import LOGICAL_SPECS_HINT
from ..._layout.spec import has_sharding, Lead
from ..._trees import like as _like, paths as _paths, walk as _tree
from ..._trees.stacked import StackedSpec
from .trace import is_array


def _missing_axes(spec: PartitionSpec, mesh: Any) -> list[str]:
    names = set(mesh.axis_names)
    return [a for entry in _spec.entries_of(spec) for a in entry if a not in names]


def on_mesh(x: Any, mesh: Any) -> bool:
    """Whether an input of `fn` is laid out on `mesh` already (it keeps its
    layout: replicating the parameters of `opt.init(params)` would put a whole
    parameter on every device)."""
    sharding = getattr(x, "sharding", None)
    return (  # a PRNG key's spec covers its key data's dims too: not kept
        isinstance(sharding, NamedSharding)
        and sharding.mesh == mesh
        and len(sharding.spec) <= len(getattr(x, "shape", ()))
        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    )


def mesh_of(request: Any) -> Any:
    """`mesh=`; else `None` under a context mesh (it applies); else the mesh of
    the first array placed with a `NamedSharding` in `like=`, or in the
    positional arguments that are trees when `like` is not given (the
    parameters)."""
    if request.mesh is not None or request.like is False:
        return request.mesh
    if _mesh.context_mesh() is not None or _mesh.set_concrete_mesh() is not None:
        return None
    if request.annotations is not None or request.rules is not None:
        return None
    if request.like is not None:
        return _like.like_mesh(request.like)
    trees = [
        a
        for a in request.args
        if jax.tree_util.tree_structure(a).num_nodes > 1 or _one_array_params(a)
    ]
    return _like.like_mesh(trees)


def like_of(request: Any, abstract: Any) -> Optional[tuple]:
    """The leaves and walk plan of the tree `request`'s result follows (`like=`),
    or `None`. Given as `like=`, or else (no `annotations` or `rules`) the first
    positional argument holding an array whose structure the result holds
    (`params` of `opt.init(params)`), or that is one array placed with a
    `NamedSharding` (no key) when the result declares no layout of its own
    (`adam(...).init(w)`: every array of a result holds one array's structure)."""
    if request.like is False:
        return None
    if request.like is not None:
        return _tree.plan_for(request.like)
    if request.annotations is not None or request.rules is not None:
        return None
    for arg in request.args:
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        if treedef.num_nodes < 2:
            if not _one_array_params(arg) or _declares(abstract):
                continue
        elif not any(is_array(x) for x in leaves):
            continue  # not a tree of parameters
        if _like.params_shaped(abstract, _like.array_structure(arg)) is not None:
            return _tree.plan_for(arg)
    return None


def _declares(abstract: Any) -> bool:
    """Whether the result's walk (its modules' fields) declares a layout."""
    return any(map(has_sharding, _tree.plan_for(abstract)[1].annotations))


def _one_array_params(x: Any) -> bool:
    """An argument that is one array placed with a `NamedSharding`, and no key
    (typed, or a raw `uint32[2]`)."""
    if not isinstance(getattr(x, "sharding", None), NamedSharding):
        return False
    if not is_array(x) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return False
    return not (x.dtype == jax.numpy.uint32 and tuple(x.shape)[-1:] == (2,))


def leaf_shardings(
    abstract: Any,
    mesh: Any,
    annotations: Any,
    rules: Any,
    stacked: Optional[Mapping[str, StackedSpec]],
    strict: bool,
    what: str,
    like: Optional[tuple] = None,
) -> list[Optional[NamedSharding]]:
    """One `NamedSharding` per leaf of `abstract` (`None` for non-array leaves).

    Unannotated array leaves are replicated (an error if `strict`). Raises one
    `ShardingAnnotationError` listing every leaf that cannot be laid out. With
    `like` (its leaves and walk plan): the layout `like=`'s rule gives.
    """
    if like is not None:
        leaves, plan = _tree.plan_for(abstract)
        specs = _like.like_specs(abstract, leaves, plan, like, f"{what}(like=...)")
        return [
            NamedSharding(mesh, spec) if is_array(leaf) else None
            for leaf, spec in zip(leaves, specs)
        ]
    leaves, plan = _tree.plan_for(abstract, annotations, rules, stacked)
    _tree.refuse_problems(leaves, plan, what, "output")
    sizes = _mesh.sizes(mesh)
    problems: list[str] = []
    unannotated: list[str] = []
    out: list[Optional[NamedSharding]] = []
    for leaf, annotation, path in zip(leaves, plan.annotations, plan.paths):
        name = "output" + jax.tree_util.keystr(path)
        if not is_array(leaf):
            out.append(None)
            continue
        shape = tuple(leaf.shape)
        if not has_sharding(annotation):
            if strict:
                unannotated.append(name)
            out.append(NamedSharding(mesh, PartitionSpec()))
            continue
        try:
            # A stacked leaf's annotation is a `Lead`: its declared dims first.
            # Logical annotations resolve here, with the rules in force.
            spec = _bridge.spec_for(annotation, shape, mesh, name)
        except ShardingAnnotationError as error:
            fixed = _given.fixed_rank(annotation)
            extra = len(shape) - fixed if fixed is not None else 0
            text = str(error)
            if extra > 0 and not isinstance(annotation, Lead):
                text = text.split(_given.STACK_HINT)[0] + _given.stack_hint(
                    extra, _paths.rule_path(path)
                )
            problems.append(f"  {text}")
            out.append(None)
            continue
        missing = _missing_axes(spec, mesh)
        if missing:
            axes = ", ".join(repr(a) for a in mesh.axis_names)
            problems.append(
                f"  {name}: {_given.describe(annotation)} names mesh axis "
                f"{missing[0]!r}, which the mesh {_mesh.format_mesh(mesh)} lacks "
                f"(axes {axes}). Fix the axis name, or pass the mesh you meant."
                + LOGICAL_SPECS_HINT
                * isinstance(annotation, PartitionSpec)
            )
            out.append(None)
            continue
        bad = _spec.indivisible(shape, spec, sizes, leaf.dtype)
        if bad:
            problems.append(f"  {name}: {bad}")
            out.append(None)
            continue
        out.append(NamedSharding(mesh, spec))
    if unannotated:
        problems.append(
            "  unannotated (strict=True): "
            + ", ".join(unannotated)
            + ". Annotate them (field annotations, `annotations=` or `rules=`), or "
            "pass strict=False to replicate them."
        )
    if problems:
        raise ShardingAnnotationError(
            f"{what}: {len(problems)} leaf/leaves cannot be created as annotated "
            f"on the mesh {_mesh.format_mesh(mesh)} (found before compiling):\n"
            + "\n".join(problems)
        )
    return out
