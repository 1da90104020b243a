"""The bytes XLA stores an array in, per dtype: sub-byte types packed.

XLA packs the elements of a type narrower than a byte (`int4`, `uint4`,
`float4_e2m1fn`: 2 per byte; `int2`, `uint2`: 4 per byte) and rounds the
buffer up to whole bytes; `bool` and the 1-bit `int1` / `uint1` (XLA's `pred`)
take one byte each. A 64-bit type is stored in 32 bits unless `jax_enable_x64`
is on, as JAX lowers it. `numpy`'s `itemsize` is 1 for every sub-byte type.
"""

import math
from typing import Any

import jax
import ml_dtypes
import numpy as np


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
        return 8 if bits == 1 else bits  # 1 bit: XLA's `pred`, a byte
    return 8
