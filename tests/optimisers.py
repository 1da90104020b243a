"""The optax optimisers the optimiser-state tests run over, and a small module."""

import equinox as eqx
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float


optax = pytest.importorskip("optax")


class Dense(eqx.Module):
    w: Float[Array, "a b", P("data", "model")]
    b: Float[Array, "b", P("model")]  # noqa: F821


OPTIMISERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "chain_clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=4),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-3
    ),
}
