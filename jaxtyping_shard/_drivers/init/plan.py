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
from ..._layout.spec import has_sharding, Lead
from ..._trees import paths as _paths, walk as _tree
from ..._trees.stacked import StackedSpec
from .trace import is_array


def _missing_axes(spec: PartitionSpec, mesh: Any) -> list[str]:
    names = set(mesh.axis_names)
    return [a for entry in _spec.entries_of(spec) for a in entry if a not in names]


def leaf_shardings(
    abstract: Any,
    mesh: Any,
    annotations: Any,
    rules: Any,
    stacked: Optional[Mapping[str, StackedSpec]],
    strict: bool,
    what: str,
) -> list[Optional[NamedSharding]]:
    """One `NamedSharding` per leaf of `abstract` (`None` for non-array leaves).

    Unannotated array leaves are replicated (an error if `strict`). Raises one
    `ShardingAnnotationError` listing every leaf that cannot be laid out.
    """
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
