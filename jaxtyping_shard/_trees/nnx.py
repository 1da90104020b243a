"""Flax NNX's partitioning metadata, read as an annotation by the tree walk.

A `flax.nnx.Variable` is a pytree node whose one child is its value (key path
`.value`); its `out_sharding` metadata (what `nnx.with_partitioning`,
`nnx.Param(..., out_sharding=...)` and the deprecated `sharding` /
`sharding_names` aliases all write, with stacked axes inserted by `nnx.vmap` /
`nnx.scan`'s `transform_metadata`) names one axis per leading dim: a logical
name, a mesh axis, or `None`. Read as Flax reads it: a name the rules in force
map is logical, one they do not is a mesh axis (`MeshOrLogical`); resolved by
`_layout.resolve` with `jts.axis_rules`' table, like any logical annotation.

Flax is never imported: a Variable is known by its class (a class named
`Variable` of a `flax` module in its MRO) and read through its public
`get_metadata()`.
"""

import functools as ft
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout import given as _given, resolve as _resolve, spec as _spec
from .._layout.logical import annotation_for, MeshOrLogical
from .._rules.scope import current as _current_rules, rules_text as _rules_text


@ft.lru_cache(maxsize=256)
def _is_variable_type(cls: type) -> bool:
    return any(
        base.__name__ == "Variable" and base.__module__.startswith("flax.")
        for base in cls.__mro__
    )


def is_variable(node: Any) -> bool:
    """Whether `node` is a Flax NNX `Variable` (`nnx.Param`, `nnx.BatchStat`, ...)."""
    return _is_variable_type(type(node))


def metadata_annotation(node: Any, where: str = "a Variable") -> Any:
    """The annotation a Variable's `out_sharding` metadata makes, or `None` (no
    metadata, or `None` there). Metadata it cannot read is refused, naming
    `where` (its key path): never passed over as if it declared nothing."""
    try:
        sharding = node.get_metadata().get("out_sharding")
    except Exception as e:  # a Variable-like object without NNX's metadata
        raise ShardingAnnotationError(
            f"`{where}`: the NNX Variable's metadata cannot be read "
            f"({type(e).__name__}: {e}), so its out_sharding is not known; nothing "
            "is checked from it. Give the leaf's layout (`annotations=`, `rules=`)."
        ) from None
    if sharding is None:
        return None
    try:
        return _annotation(_hashable(sharding))
    except ShardingAnnotationError as e:
        raise ShardingAnnotationError(
            f"`{where}`: {e} Nothing is checked from it; fix the metadata or give "
            "the leaf's layout (`annotations=`, `rules=`)."
        ) from None


def _hashable(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        sharding = sharding.spec
    if isinstance(sharding, PartitionSpec):
        return ("spec", sharding)
    if isinstance(sharding, (tuple, list)):
        return (
            "names",
            tuple(tuple(x) if isinstance(x, list) else x for x in sharding),
        )
    return ("other", repr(sharding))


@ft.lru_cache(maxsize=1024)
def _annotation(key: tuple) -> Any:
    kind, sharding = key
    if kind == "other":
        raise ShardingAnnotationError(
            f"NNX metadata out_sharding={sharding} is not a tuple of axis names, a "
            "PartitionSpec or a NamedSharding."
        )
    names = tuple(sharding)
    source = f"NNX metadata out_sharding={names!r}"
    for name in names:
        axes = name if isinstance(name, tuple) else () if name is None else (name,)
        if not all(isinstance(a, str) for a in axes):
            raise ShardingAnnotationError(
                f"NNX metadata out_sharding={names!r}: {name!r} is not an axis name "
                "(a string, a tuple of mesh axes, or None for a dim never sharded)."
            )
    if all(n is None or (isinstance(n, str) and n.isidentifier()) for n in names):
        if not names:
            return PartitionSpec()
        dims = " ".join(["_"] * len(names) + ["..."])
        return annotation_for(dims, MeshOrLogical(*names, None, source=source))
    # Several mesh axes for one dim (`('data', 'fsdp')`): Flax looks a tuple up as
    # one name, which no rule has, so it reads them as mesh axes.
    return PartitionSpec(*names)


def with_metadata(node: Any, where: str, hint: Any, field: Any) -> Any:
    """A Variable's hint: its metadata's annotation where the hint from above
    declares nothing (`field`: what it says of one array, `None` for nothing);
    the hint, when they agree; an error naming `where` when not."""
    meta = metadata_annotation(node, where)
    if meta is None:
        return hint
    if field is None:
        return meta
    values = jax.tree_util.tree_leaves(node)
    ndim = len(getattr(values[0], "shape", ())) if values else 0
    if not agree(field, meta, ndim):
        raise disagreement(where, field, node)
    return hint


def agree(field: Any, meta: Any, ndim: int) -> bool:
    """Whether a field annotation and a Variable's metadata ask for one layout for
    an array of rank `ndim`: the same names, or the same spec under the rules in
    force (mesh not known: names without a rule taken as mesh axes)."""
    try:
        a = _given.layout_of(field)
        b = _given.layout_of(meta)
    except Exception:  # a union of annotations, say: the field's is checked
        return True
    if isinstance(a, _spec.LogicalLayout) and isinstance(b, _spec.LogicalLayout):
        if a.names(ndim) == b.names(ndim):
            return True
    rules = _current_rules()
    try:
        left = _resolve.resolve(a, ndim, None, rules)
        right = _resolve.resolve(b, ndim, None, rules)
    except ShardingAnnotationError:
        return False
    return _trim(left) == _trim(right)


def _trim(entries: tuple) -> tuple:
    out = list(entries)
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def disagreement(path_text: str, field: Any, node: Any) -> ShardingAnnotationError:
    written = node.get_metadata().get("out_sharding")
    return ShardingAnnotationError(
        f"`{path_text}`: the field annotation {_given.describe(field)} and the "
        f"Variable's NNX metadata out_sharding={written!r} disagree (under the "
        f"axis rules in force: {_rules_text()}). Say the layout once: drop the "
        "field annotation (the NNX metadata is read as an annotation) or make the "
        "two agree."
    )
