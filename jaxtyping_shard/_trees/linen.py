"""Flax Linen's partitioning boxes, read as annotations by the tree walk.

`nn.with_partitioning` and `nn.with_logical_partitioning` wrap a parameter in a
box: `flax.core.meta.Partitioned` (its `names` are mesh axes) or
`flax.linen.LogicallyPartitioned` (logical names). A box is a pytree node whose
one child is its value (key path `.value`); `names` (and `rules`) are its
metadata. The walk reads a box as the annotation of its value, as it reads an
NNX Variable's metadata (`nnx.py`), on the boxed tree itself and, given as
`annotations=`, on the unboxed state (a box in an annotation tree is the
annotation of the leaf at its place).

The rules a `LogicallyPartitioned` box is read by, strongest first: the box's
own `rules` (`nn.with_logical_partitioning(..., rules=...)`, as Linen's
`unbox` reads them: resolved here, in Linen's order of priority); else the
rules in force (`jts.axis_rules`, a per-call `axis_rules=`,
`jts.set_axis_rules`). Linen's own `nn.logical_axis_rules` context is not read
implicitly (JAX's caches do not key on it): pass the same table,
`jts.axis_rules(nn.get_logical_axis_rules())`; an error says so when it is set
and no rules of this library are.

Metadata of a form known but not read (names of another length than the
array's rank, names that are not strings or `None`, a subclass of a box or
another Flax `AxisMetadata` carrying layout) is refused by key path, never
passed over (`UnreadableMetadata`).

Flax is never imported: a box is known by its class (module and name in its
MRO).
"""

import functools as ft
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout import given as _given, resolve as _resolve, spec as _spec
from .._layout.conflicts import LINEN_SOURCE
from .._layout.logical import annotation_for, LinenNames
from .._rules.scope import rules_text as _rules_text
from .._rules.table import AxisRules


_KNOWN = {
    ("flax.core.meta", "Partitioned"): "mesh",
    ("flax.linen.spmd", "LogicallyPartitioned"): "logical",
}
_BOXES = ("Partitioned", "LogicallyPartitioned")
# Where Flax's other axis metadata (the NNX bridge's `NNXMeta`) keeps a layout.
_LAYOUT_KEYS = ("out_sharding", "sharding", "sharding_names", "names")


@ft.lru_cache(maxsize=256)
def _kind(cls: type) -> Optional[str]:
    """`"mesh"`, `"logical"`, `"subclass"` (a box's subclass, not read),
    `"metadata"` (another Flax `AxisMetadata`: layout or not, per instance), or
    `None` (not Flax axis metadata)."""
    known = _KNOWN.get((cls.__module__, cls.__qualname__))
    if known:
        return known
    mro = [(b.__module__, b.__name__) for b in cls.__mro__]
    if any(m.startswith("flax.") and n in _BOXES for m, n in mro):
        return "subclass"
    if ("flax.core.meta", "AxisMetadata") in mro:
        return "metadata"
    return None


def is_box(node: Any) -> bool:
    """Whether `node` is Flax axis metadata (`nn.Partitioned`,
    `nn.LogicallyPartitioned`, a subclass, the NNX bridge's `NNXMeta`)."""
    return _kind(type(node)) is not None


class UnreadableMetadata(ShardingAnnotationError):
    """Layout metadata of a form known but not read: named by key path."""


def _refuse(where: str, node: Any, why: str) -> UnreadableMetadata:
    cls = type(node)
    return UnreadableMetadata(
        f"`{where}`: {cls.__module__}.{cls.__qualname__} carries layout metadata "
        f"this library cannot read: {why}. Nothing is checked or laid out from "
        "it; fix the metadata, or give the leaf's layout yourself "
        "(`annotations=` or a path rule `rules=` speak for it)."
    )


def annotation(node: Any, where: str) -> Any:
    """The annotation a box makes for its value (`where`: its key path, for
    messages), or `None` for axis metadata that declares no layout. Raises
    `UnreadableMetadata`, naming `where`, for a form it cannot read."""
    kind = _kind(type(node))
    if kind == "metadata":
        held = _layout_held(node)
        if held is None:
            return None
        raise _refuse(where, node, f"{held}, in a kind of Flax axis metadata not read")
    if kind == "subclass":
        raise _refuse(
            where,
            node,
            "a subclass of a Linen box, whose reading of its names "
            f"{getattr(node, 'names', None)!r} may differ from Flax's; only "
            "nn.Partitioned and nn.LogicallyPartitioned themselves are read",
        )
    names = getattr(node, "names", None)
    shape = getattr(getattr(node, "value", None), "shape", None)
    if shape is None:
        raise _refuse(where, node, "its value is not an array")
    if not isinstance(names, (tuple, list)) or len(names) != len(shape):
        count = f"{len(names)} names" if isinstance(names, (tuple, list)) else "names"
        raise _refuse(
            where,
            node,
            f"{count} {names!r} for an array of rank {len(shape)} (shape "
            f"{tuple(shape)}); give one name per dim (None where replicated; a "
            "stacked dim needs `metadata_params={nn.PARTITION_NAME: 'layers'}` on "
            "nn.scan / nn.vmap)",
        )
    rules = getattr(node, "rules", None) if kind == "logical" else None
    try:
        return _annotation(kind, _deep_tuple(names), _deep_tuple(rules))
    except UnreadableMetadata as e:
        raise _refuse(where, node, str(e)) from None
    except ShardingAnnotationError as e:
        raise ShardingAnnotationError(f"`{where}`: {e}") from None


def _layout_held(node: Any) -> Optional[str]:
    for key in _LAYOUT_KEYS:
        value = getattr(node, key, None)
        if value is None and isinstance(getattr(node, "metadata", None), dict):
            value = node.metadata.get(key)
        if value is not None:
            return f"{key}={value!r}"
    return None


def _deep_tuple(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_deep_tuple(e) for e in x)
    return x


@ft.lru_cache(maxsize=1024)
def _annotation(kind: str, names: tuple, rules: Any) -> Any:
    for name in names:
        if kind == "mesh" and isinstance(name, tuple):
            ok = all(isinstance(a, str) for a in name)
        else:
            ok = name is None or isinstance(name, str)
        if not ok:
            what = "mesh axes" if kind == "mesh" else "logical names"
            raise UnreadableMetadata(
                f"the name {name!r} in names={names!r} is not one of its {what} "
                "(a string, or None for a dim never sharded)"
            )
    if kind == "mesh" or not names:  # a scalar's `()` too: replicated
        return PartitionSpec(*names)
    marker = LinenNames(
        *names, source=f"{LINEN_SOURCE} box nn.LogicallyPartitioned(names={names!r})"
    )
    made = annotation_for(" ".join(["_"] * len(names)), marker)
    if rules is None:
        return made  # resolved by the rules in force when checked
    # The box's own rules, as Linen's `unbox` reads them (mesh not known yet).
    table = AxisRules(rules)
    entries = _resolve.resolve(_given.layout_of(made), len(names), None, table)
    return _spec.make_spec(entries)


def logical_specs(tree: Any) -> Any:
    """Flax's logical spec tree read in logical names, for `annotations=`.

    `nn.get_partition_spec(boxed)` gives a `PartitionSpec` per leaf in the
    box's logical names (`P('embed', 'mlp')`), and `P()` for an unboxed array.
    Passed as it is, a `PartitionSpec` names mesh axes; `logical_specs(specs)`
    says its names are logical: each `P(...)` with names becomes the annotation
    a `LogicallyPartitioned` box with those names makes (resolved by the rules
    in force when checked; a spec naming fewer dims than the array has leaves
    the others replicated), `P()` stays replicated, `None` stays nothing given.

    !!! Example

        ```python
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts

        kernel = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp"))
        model = nn.Dense(16, kernel_init=kernel, use_bias=False)
        boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 8)))
        specs = nn.get_partition_spec(boxed)  # P('embed', 'mlp'): logical
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        with jts.axis_rules([("embed", "data"), ("mlp", "model")]):
            out = jts.shardings(nn.unbox(boxed), mesh,
                                annotations=jts.logical_specs(specs))
        ```

    **Raises:** `ShardingAnnotationError` for an entry that is not a logical
    name (a tuple of mesh axes, say), naming its key path.
    """

    def one(path: tuple, spec: Any) -> Any:
        if not isinstance(spec, PartitionSpec):
            return spec
        names = tuple(spec)
        if not names:
            return spec
        try:
            marker = LinenNames(
                *names,
                None,
                source=f"{LINEN_SOURCE} logical spec {_spec.format_spec(spec)}",
            )
        except ShardingAnnotationError as e:
            raise ShardingAnnotationError(
                f"logical_specs: at `{jax.tree_util.keystr(path)}`: {e}"
            ) from None
        return annotation_for(" ".join(["_"] * len(names) + ["..."]), marker)

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def is_array_like(x: Any) -> bool:
    """An array or `ShapeDtypeStruct` (not a class): in a boxed tree given as
    annotations, a leaf the program did not box, which declares nothing."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def box_key(node: Any) -> Any:
    """What of a box in an annotation tree decides its annotation (plan keys)."""
    shape = getattr(getattr(node, "value", None), "shape", None)
    names = _deep_tuple(getattr(node, "names", None))
    rules = _deep_tuple(getattr(node, "rules", None))
    return (type(node), names, rules, None if shape is None else tuple(shape))


def with_metadata(node: Any, where: str, hint: Any, field: Any, agree: Any) -> Any:
    """A box's hint: its annotation where the hint from above declares nothing
    (`field`: what that hint says of one array, `None` for nothing); the hint,
    when it says the same (`agree`: NNX's comparison, `nnx.agree`, passed in:
    one module less in the chain of imports); an error naming `where` when
    not."""
    made = annotation(node, where)
    if made is None:
        return hint
    if field is None:
        return made
    ndim = len(node.value.shape)
    if agree(field, made, ndim):
        return hint
    raise ShardingAnnotationError(
        f"`{where}`: the field annotation {_given.describe(field)} and the Linen "
        f"box's names={tuple(node.names)!r} ({type(node).__name__}) disagree "
        f"(under the axis rules in force: {_rules_text()}). Say the layout once: "
        "drop the field annotation (the box is read as an annotation) or make "
        "the two agree."
    )
