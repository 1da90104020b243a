"""AdamW, written by hand with `jax.tree`; its state is annotated as the parameters.

`AdamState.mu` and `.nu` are annotated with the model's class, so the tree walk
gives each moment the annotation of its parameter: `jts.sharded_init` creates
them in the parameters' shards, and `jts.jit` checks them at every step.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

import jaxtyping_shard as jts

from .model import Transformer


LEARNING_RATE, B1, B2, EPS, WEIGHT_DECAY = 1e-2, 0.9, 0.99, 1e-8, 1e-4


class AdamState(eqx.Module):
    count: jts.Int[Array, ""]
    mu: Transformer  # each moment annotated as its parameter
    nu: Transformer


def adamw_init(params: Transformer) -> AdamState:
    """Zero moments; laid out by `jts.sharded_init` from `AdamState`'s annotations."""
    zeros = lambda p: jnp.zeros(p.shape, p.dtype)  # noqa: E731
    return AdamState(
        jnp.zeros((), jnp.int32),
        jax.tree.map(zeros, params),
        jax.tree.map(zeros, params),
    )


def adamw_update(
    params: Transformer, grads: Transformer, state: AdamState
) -> tuple[Transformer, AdamState]:
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, state.nu, grads)
    step = count.astype(jnp.float32)
    bias1, bias2 = 1 - B1**step, 1 - B2**step

    def update(p, m, v):
        adam = (m / bias1) / (jnp.sqrt(v / bias2) + EPS)
        return p - LEARNING_RATE * (adam + WEIGHT_DECAY * p)

    return jax.tree.map(update, params, mu, nu), AdamState(count, mu, nu)
