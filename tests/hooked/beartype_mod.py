"""Checked through jaxtyping's import hook with beartype (see test_annotation.py)."""

from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float


def scale(
    x: Float[Array, "b e", P("data", None)],
) -> Float[Array, "b e", P("data", None)]:
    return x * 2
