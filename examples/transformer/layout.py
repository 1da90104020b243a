"""The one rules table: logical names -> mesh axes, per parallelism layout.

The only place in the program where mesh axes are written (besides the mesh
itself), and the two specs of the gradient accumulation's `reduced` /
`unreduced` marks (`reduced_over`, `unreduced_zeros`). Switching between data
parallelism, FSDP and FSDP + tensor parallelism changes nothing but the table
in force.
"""

import jax
import jax.numpy as jnp

import jaxtyping_shard as jts


_SAME = {"seq": None, "norm": None}  # never sharded here

RULES = {
    # Pure data parallelism: the batch over every device, parameters replicated.
    "dp": {
        "batch": ("data", "model"),
        "vocab": None,
        "embed": None,
        "heads": None,
        "mlp": None,
        **_SAME,
    },
    # FSDP: the batch over every device, each parameter split over them too
    # (along `embed`) where stored, and gathered where used (`jts.fsdp`).
    "fsdp": {
        "batch": ("data", "model"),
        "embed": jts.fsdp("data", "model"),
        "vocab": None,
        "heads": None,
        "mlp": None,
        **_SAME,
    },
    # FSDP over `data` plus tensor parallelism over `model` (Megatron's split:
    # heads and the MLP's hidden dim column-parallel, their outputs row-parallel).
    "fsdp_tp": {
        "batch": "data",
        "embed": jts.fsdp("data"),
        "vocab": "model",
        "heads": "model",
        "mlp": "model",
        **_SAME,
    },
}


# Gradient accumulation on an `Explicit` mesh (`train.accumulate_unreduced`):
# the weights marked `reduced` over the batch's mesh axes, their gradients
# `unreduced` over them through the micro-batch scan.


def reduced_over(axes: frozenset, x: jax.Array) -> jax.Array:
    """`x` as it is, marked `reduced` over `axes` (its gradient comes back
    unreduced over them); `x` must be replicated over them."""
    marked = jax.typeof(x).sharding.spec.update(reduced=axes)
    return jts.reshard(x, marked)


def unreduced_zeros(x: jax.Array) -> jax.Array:
    """Zeros for the gradient of `x`: unreduced over the axes `x` is reduced
    over, laid out as `x` otherwise."""
    spec = jax.typeof(x).sharding.spec
    if not spec.reduced:
        return jnp.zeros_like(x)
    pending = spec.update(unreduced=spec.reduced, reduced=frozenset())
    return jnp.zeros(x.shape, x.dtype, out_sharding=jts.out_sharding(pending))
