"""What a value tells the resolution of its annotation: its shape and its mesh.

A logical annotation means, for one value, what `_layout.resolve` gives for the
value's global shape and mesh under the rules in force. Every path that resolves
an annotation for a value it holds (the checks, `check_tree`'s `like=` and
`stacked=`) reads those two here, so that all of them resolve alike; the drivers,
which place values that do not exist yet, pass the shape and mesh they are
building for to the same `_layout.bridge.spec_for`.
"""

from typing import Any, Optional, Union

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding

from .._core import mesh as _mesh
from .._layout import spec as _spec
from .manual import in_spec_of


def of_value(obj: Any) -> tuple[Union[tuple, int], Optional[Any]]:
    """`(global shape, or rank when it is not known; mesh or None)` of a value.

    A concrete array (or `jax.ShapeDtypeStruct`): its shape, and the mesh of its
    `NamedSharding`, else the context mesh. A tracer: its shape and the mesh of
    its type. Inside `shard_map` a value is a local shard: a body's argument is
    the global array its `in_specs` split (local dims times the manual axes
    splitting them); any other value's global shape is not known, and it is
    resolved by rank (see docs/logical.md).
    """
    if isinstance(obj, Tracer):
        aval = jax.typeof(obj)
        mesh = _mesh.of_aval(aval)
        shape = tuple(aval.shape)
        if mesh is not None and AxisType.Manual in mesh.axis_types:
            return _global_of_local(obj, shape, mesh), mesh
        return shape, mesh
    sharding = getattr(obj, "sharding", None)
    if type(sharding) is NamedSharding and not sharding.mesh.empty:
        mesh = sharding.mesh
    else:
        mesh = _mesh.context_mesh()
    return tuple(getattr(obj, "shape", ())), mesh


def _global_of_local(obj: Any, local: tuple, mesh: Any) -> Union[tuple, int]:
    in_spec = in_spec_of(obj)
    if in_spec is None:
        return len(local)
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    sizes = _mesh.sizes(mesh)
    entries = _spec.entries_of(in_spec)
    shape = list(local)
    for i, entry in enumerate(entries[: len(shape)]):
        for axis in entry:
            if axis in manual:
                shape[i] *= sizes[axis]
    return tuple(shape)
