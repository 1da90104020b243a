"""A step's arguments made abstract on a mesh, for `preflight`: each array leaf a
`jax.ShapeDtypeStruct` of its shape, dtype and layout (a concrete array's
`PartitionSpec`, carried over to the mesh); its data is never read."""

from typing import Any, Optional

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._layout import spec as _spec


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def has_arrays(tree: Any) -> bool:
    return any(is_array(x) for x in jax.tree_util.tree_leaves(tree))


def abstract(tree: Any, mesh: Any) -> Any:
    """`tree` with every array leaf a `jax.ShapeDtypeStruct` on `mesh`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [_abstract_leaf(path, x, mesh) for path, x in leaves]
    )


def _abstract_leaf(path: tuple, x: Any, mesh: Any) -> Any:
    if isinstance(x, Tracer):
        raise ValueError(
            "jts.preflight takes arrays, not tracers: call it outside jit."
        )
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
    elif isinstance(x, jax.Array):
        # An uncommitted array is where jit would move it: placed as annotated.
        sharding = x.sharding if x.committed else None
    elif isinstance(x, (np.ndarray, np.generic)):
        sharding = None
    else:
        return x
    weak = bool(getattr(x, "weak_type", False))
    sharding = _rehomed(sharding, mesh, path)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)


def _rehomed(sharding: Any, mesh: Any, path: tuple) -> Optional[NamedSharding]:
    """The layout `sharding` gives, on `mesh`: the same spec (axis names)."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        missing = {
            a
            for entry in (
                *_spec.partitions_of(sharding.spec),
                tuple(_spec.unreduced_axes(sharding.spec)),
                tuple(_spec.reduced_axes(sharding.spec)),
            )
            if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)
        } - set(mesh.axis_names)
        if missing:
            raise ShardingAnnotationError(
                f"preflight: the argument leaf {jax.tree_util.keystr(path)} is laid "
                f"out over mesh axes {sorted(missing)}, which the mesh "
                f"{_mesh.format_mesh(mesh)} lacks. Preflight on a mesh with the "
                "axis names of the one the arrays were made on."
            )
        return NamedSharding(mesh, sharding.spec)
    if sharding.is_fully_replicated:  # on one device, or whole on several
        return NamedSharding(mesh, PartitionSpec())
    raise ValueError(
        f"preflight: the argument leaf {jax.tree_util.keystr(path)} is laid out as "
        f"{sharding}, which names no mesh axes to carry over to the mesh. Place it "
        "with a NamedSharding, or pass a jax.ShapeDtypeStruct."
    )


def unplaced(arguments: list, mesh: Any) -> set[str]:
    """The paths (`params['w']`) of the array leaves given without a layout (a
    `ShapeDtypeStruct` with no sharding, an uncommitted or NumPy array), which
    are placed as annotated: their own layout is not checked."""
    found = set()
    for name, value, _ in arguments:
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract(value, mesh))[
            0
        ]:
            if is_array(leaf) and getattr(leaf, "sharding", None) is None:
                found.add(name + jax.tree_util.keystr(path))
    return found
