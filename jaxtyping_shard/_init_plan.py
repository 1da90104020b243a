"""What `sharded_init` will create, decided before anything is compiled.

From the abstract output tree (shapes and dtypes, no data) and the one tree walk
(`_tree.plan_for`), one `NamedSharding` per array leaf, through the bridge
(`_bridge.spec_for`, `_bridge.named_sharding`). Every leaf that cannot be laid
out as annotated (a dim its mesh axes do not divide, an axis the mesh lacks, a
rank the annotation contradicts) is collected, and all of them are reported in
one error, by key path, with the padded size that would fix a dim.
"""

import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

from . import _bridge, _mesh, _paths, _spec, _tree
from ._errors import ShardingAnnotationError


# `stacked=` values: how many extra leading dims, or one spec entry for each.
StackedSpec = Union[int, tuple]


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
    )


def _leading(value: Any, pattern: str) -> tuple:
    if isinstance(value, bool) or not isinstance(value, (int, tuple)):
        raise ShardingAnnotationError(
            f"stacked[{pattern!r}] must be the number of extra leading dims (`1`) or "
            f"one spec entry per extra dim (`('pipe',)`, `(None,)`), not {value!r}."
        )
    if isinstance(value, int):
        if value < 1:
            raise ShardingAnnotationError(
                f"stacked[{pattern!r}] = {value}: a stack adds at least one dim."
            )
        return (None,) * value
    if not value:
        raise ShardingAnnotationError(
            f"stacked[{pattern!r}] = (): a stack adds at least one dim."
        )
    _spec.validate_spec(PartitionSpec(*value), f"stacked[{pattern!r}]")
    return value


def stacked_prefixes(
    paths: tuple, stacked: Optional[Mapping[str, StackedSpec]]
) -> list[tuple]:
    """For each leaf, the spec entries of its declared extra leading dims."""
    out: list[tuple] = [()] * len(paths)
    if not stacked:
        return out
    if not isinstance(stacked, Mapping):
        raise ShardingAnnotationError(
            f"stacked must map a path pattern to a number of leading dims, e.g. "
            f"{{'blocks/**': 1}}, not {type(stacked).__name__}."
        )
    texts = [_paths.rule_path(p) for p in paths]
    for pattern, value in stacked.items():
        lead = _leading(value, pattern)
        regex = _paths.compile_pattern(pattern)  # the rules' pattern syntax
        hits = [i for i, text in enumerate(texts) if regex.fullmatch(text)]
        if not hits:
            sample = ", ".join(repr(t) for t in texts[:6])
            raise ShardingAnnotationError(
                f"stacked: the pattern {pattern!r} matches no leaf. Paths look like "
                f"{sample or '(no leaves)'}: keys joined with '/', `*` within a key, "
                "`**` across keys."
            )
        for i in hits:
            if out[i]:
                raise ShardingAnnotationError(
                    f"stacked: the leaf `{texts[i]}` is matched by two patterns; "
                    "declare each stack once."
                )
            out[i] = lead
    return out


def _divisibility(
    shape: tuple, spec: PartitionSpec, sizes: dict, dtype: Any
) -> Optional[str]:
    entries = _spec.entries_of(spec)
    bad = []
    padded = list(shape)
    for dim, entry in enumerate(entries):
        n = math.prod(sizes[a] for a in entry)
        if n > 1 and shape[dim] % n:
            padded[dim] = -(-shape[dim] // n) * n
            axes = entry[0] if len(entry) == 1 else "(" + ",".join(entry) + ")"
            bad.append(f"dim {dim} ({shape[dim]}) is not divisible by {axes}={n}")
    if not bad:
        return None
    want = _spec.format_array(dtype, shape, entries)
    return (
        f"`{want}`: {'; '.join(bad)}. Pad it to "
        f"{tuple(padded)} (round each such dim up to a multiple of its mesh axes' "
        "size), or shard that dim over other axes."
    )


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
    leaves, plan = _tree.plan_for(abstract, annotations, rules)
    leads = stacked_prefixes(plan.paths, stacked)
    sizes = _mesh.sizes(mesh)
    problems: list[str] = []
    unannotated: list[str] = []
    out: list[Optional[NamedSharding]] = []
    rows = zip(leaves, plan.annotations, plan.paths, leads)
    for leaf, annotation, path, lead in rows:
        name = "output" + jax.tree_util.keystr(path)
        if not is_array(leaf):
            out.append(None)
            continue
        shape = tuple(leaf.shape)
        if not _bridge.has_sharding(annotation):
            if lead:
                problems.append(
                    f"  {name}: declared stacked, but its annotation has no sharding"
                )
            elif strict:
                unannotated.append(name)
            out.append(NamedSharding(mesh, PartitionSpec()))
            continue
        if len(lead) > len(shape):
            problems.append(f"  {name}: rank {len(shape)}, fewer dims than stacked")
            out.append(None)
            continue
        try:
            inner = _bridge.spec_for(
                annotation,
                len(shape) - len(lead),
                name,
                shape=shape[len(lead) :],
                mesh=mesh,  # logical annotations resolve here, with the rules in force
            )
        except ShardingAnnotationError as error:
            fixed = _bridge.fixed_rank(annotation)
            extra = len(shape) - fixed if fixed is not None and not lead else 0
            declared = {_paths.rule_path(path): extra}
            hint = (
                " If this leaf is a stack of layers (`eqx.filter_vmap`), declare its "
                f"extra leading dims: `stacked={declared!r}`."
                if extra > 0
                else ""
            )
            problems.append(f"  {error}{hint}")
            out.append(None)
            continue
        spec = PartitionSpec(*lead, *inner)
        missing = _missing_axes(spec, mesh)
        if missing:
            axes = ", ".join(repr(a) for a in mesh.axis_names)
            problems.append(
                f"  {name}: {_bridge.describe(annotation)} names mesh axis "
                f"{missing[0]!r}, which the mesh {_mesh.format_mesh(mesh)} lacks "
                f"(axes {axes}). Fix the axis name, or pass the mesh you meant."
            )
            out.append(None)
            continue
        bad = _divisibility(shape, spec, sizes, leaf.dtype)
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
