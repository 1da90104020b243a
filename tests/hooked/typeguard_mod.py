"""Checked through typeguard's import hook (see test_annotation.py): aliases, and
`jaxtyped(typechecker=None)` so dims bind across arguments."""

from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

from jaxtyping_shard import Float


Batch = Float[Array, "b e", P("data", None)]


@jaxtyped(typechecker=None)
def add(x: Batch, y: Batch) -> Batch:
    return x + y
