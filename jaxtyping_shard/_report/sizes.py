"""The bytes XLA stores an array in, per dtype: sub-byte types packed.

XLA packs the elements of a type narrower than a byte (`int4`, `uint4`,
`float4_e2m1fn`: 2 per byte; `int2`, `uint2`: 4 per byte) and rounds the
buffer up to whole bytes; `bool` and the 1-bit `int1` / `uint1` (XLA's `pred`)
take one byte each, as do the 6-bit floats (`float6_e2m3fn`, `float6_e3m2fn`,
which XLA's CPU backend compiles from jaxlib 0.12). A 64-bit type is stored in
32 bits unless `jax_enable_x64` is on, as JAX lowers it. `numpy`'s `itemsize`
is 1 for every sub-byte type.
`shard_bytes`: an array's shard, bytes per device and bytes replicated on a mesh.
"""

import math
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError


def array_bytes(shape: Any, dtype: Any) -> int:
    """The bytes of a buffer of `shape` (a shape, or a number of elements) and
    `dtype`, as XLA's `memory_analysis()` counts them."""
    count = shape if isinstance(shape, int) else math.prod(shape)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return count * int(dtype.itemsize)  # PRNG keys: their data's bytes
    bits = element_bits(dtype)
    return -(-count * bits // 8)


def element_bits(dtype: Any) -> int:
    """The bits XLA stores one element of `dtype` in."""
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if dtype.itemsize != 1 or dtype == np.bool_:
        return 8 * dtype.itemsize
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            bits = int(info(dtype).bits)
        except (TypeError, ValueError):
            continue
        # XLA packs the widths that divide a byte evenly (2, 4 bits); a 1-bit
        # type is its `pred`, a byte, and a 6-bit float takes a byte too.
        return bits if bits in (2, 4) else 8
    return 8


_LACKS = (
    "unreduced over mesh axes {}, which the mesh {} lacks: fix the axis name in "
    "`unreduced=` (`{{U:...}}`), or pass the mesh you meant."
)


def shard_bytes(shape: Any, dtype: Any, entries: tuple, mesh: Any, unreduced=()):
    """`(shard shape, bytes per device, bytes replicated)` of an array of `shape`
    and `dtype` laid out as `entries` (mesh axes per dim) on `mesh`; `None` where
    the shape, dtype or mesh is unknown. A dim is padded as XLA pads it; over
    `unreduced` axes each copy is another partial sum, not a replica."""
    if shape is None or mesh is None:
        return None, None, None
    mesh_sizes = _mesh.sizes(mesh)
    if lacks := sorted(a for a in unreduced if a not in mesh_sizes):
        raise ShardingAnnotationError(_LACKS.format(lacks, _mesh.format_mesh(mesh)))
    entries = tuple(entries) + ((),) * (len(shape) - len(entries))
    shard = tuple(
        -(-size // math.prod(mesh_sizes[a] for a in entry))
        for size, entry in zip(shape, entries)
    )
    if dtype is None:
        return shard, None, None
    per_device = array_bytes(shard, dtype)  # sub-byte types packed, as XLA does
    devices = math.prod(mesh_sizes.values())
    distinct = array_bytes(shape, dtype) * math.prod(mesh_sizes[a] for a in unreduced)
    replicated = max(per_device * devices - distinct, 0)
    return shard, per_device, replicated
