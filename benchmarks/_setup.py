"""What the eager, trace and compile figures share: the 4x2 mesh, the arrays
placed on it, the annotations with and without a sharding, and the liveness test.
Imported only after the CPU device count is forced (`_devices`)."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float


AXES = ("data", "model")
SHAPE = (8, 4)
# Eight arguments, each annotated with the spec it is placed with.
SPECS = (P("data", None), P(None, "model"), P("data", "model"), P(), P("model", None))
SPECS += (P(None, "data"), P(("data", "model"), None), P("data", None))


def make_mesh(kind: str) -> Any:
    axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
    return jax.make_mesh((4, 2), AXES, axis_types=(axis_type,) * 2)


def place(mesh: Any, spec: Any) -> Any:
    x = jnp.arange(SHAPE[0] * SHAPE[1], dtype=jnp.float32).reshape(SHAPE)
    return jax.device_put(x, NamedSharding(mesh, spec))


def sharded(spec: Any) -> Any:
    return Float[Array, "b e", spec]


PLAIN = jaxtyping.Float[Array, "b e"]


def raises(fn: Callable[[], Any], error: type = Exception) -> bool:
    """Whether `fn()` raises `error`: a figure's check is live when a mis-sharded
    value is refused."""
    try:
        fn()
    except error:
        return True
    return False
