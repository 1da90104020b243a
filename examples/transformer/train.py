"""The training program: data, the step, the loop, the checkpoint.

Parameters and optimiser state are created by `jts.sharded_init`, batches
placed by `jts.place`, the step compiled by `jts.jit` with its shardings read
off its signature; it accumulates gradients over micro-batches and updates with
optax. A checkpoint is saved with Orbax and restored onto a target from
`jts.abstract`, under any rules table and mesh. Checks are on throughout. No
`PartitionSpec` or `NamedSharding` is written here.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

import jaxtyping_shard as jts

from .layout import reduced_over, RULES, unreduced_zeros
from .model import Config, cross_entropy, Scalar, Tokens, Transformer
from .optim import optimizer


MICRO = 2  # micro-batches per step: the gradients are accumulated over them


class Batch(eqx.Module):
    tokens: Tokens
    labels: Tokens


def loss_fn(params: Transformer, batch: Batch) -> Scalar:
    # Each gradient comes back laid out as its parameter: the weights are used
    # through `jts.as_used`, whose gradient is laid out as stored.
    return cross_entropy(params(batch.tokens), batch.labels)


def micro_batches(batch: Batch) -> Batch:
    """`[batch, seq]` -> `[MICRO, batch / MICRO, seq]`: micro-batch `i` holds rows
    `i, i + MICRO, ...`, so each device splits its own rows and none moves."""

    def split(x):
        rows, seq = x.shape
        return jnp.swapaxes(x.reshape(rows // MICRO, MICRO, seq), 0, 1)

    return jax.tree.map(split, batch)


def accumulate(params: Transformer, batch: Batch) -> tuple[Scalar, Transformer]:
    """The sums of the micro-batches' losses and gradients, each micro-batch's
    gradient reduced over `data` as it is made (the `Auto` mesh's path)."""
    grad_fn = eqx.filter_value_and_grad(loss_fn)

    def add(carry, micro: Batch):
        loss, grads = grad_fn(params, micro)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(add, zero, micro_batches(batch))[0]


def batch_axes() -> frozenset:
    """The mesh axes the batch is split over, under the rules in force."""
    first = jts.spec_of(Tokens)[0]
    return frozenset((first,) if isinstance(first, str) else first or ())


def deferred_reduction(params: Transformer) -> bool:
    """Whether the gradients can stay unreduced over the batch's axes through
    the micro-batch scan: JAX has `reduced` / `unreduced` only on `Explicit`
    axes (on `Auto` ones XLA decides where sums happen), so an `Auto` mesh
    keeps `accumulate`."""
    mesh = jax.typeof(params.embed).sharding.mesh
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    axes = batch_axes()
    return bool(axes) and all(types[a] == AxisType.Explicit for a in axes)


def accumulate_unreduced(
    params: Transformer, batch: Batch
) -> tuple[Scalar, Transformer]:
    """As `accumulate`, with one reduction of the gradients over the batch's
    axes (`data`) per step: JAX's gradient accumulation on `Explicit` axes.
    The parameters are gathered once, before the loop (the FSDP all-gathers,
    once a step instead of once a layer and micro-batch), and marked `reduced`
    over those axes, so that each micro-batch's gradient comes back
    *unreduced* over them (a pending sum); the scan adds them unreduced, and
    `jts.reshard` to the stored layout sums them once, scattering each back to
    its FSDP shards."""
    gathered = jts.as_used(params)
    # The matmuls' weights reduced. The norms' scales stay as stored (the
    # model uses them so, checked by `Scale`): they multiply activations split
    # over `data` elementwise, which JAX refuses for a reduced operand, so
    # their gradients (a vector each) are reduced per micro-batch as before.
    marked = jax.tree.map(functools.partial(reduced_over, batch_axes()), gathered)
    reduced = eqx.tree_at(_scales, marked, _scales(params))
    grad_fn = eqx.filter_value_and_grad(loss_fn)

    def add(carry, micro: Batch):
        loss, grads = grad_fn(reduced, micro)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    # Inside, the weights are gathered already: each `jts.as_used` is a no-op.
    with jts.axis_rules(jts.get_axis_rules().as_used()):
        zero = (jnp.zeros(()), jax.tree.map(unreduced_zeros, reduced))
        loss, grads = jax.lax.scan(add, zero, micro_batches(batch))[0]
    return loss, jts.reshard(grads)  # the one reduction over data of the step


def _scales(params: Transformer) -> tuple:
    return params.ln_f, params.blocks.ln1, params.blocks.ln2


# `jts.Like["params"]`: the optimiser state laid out as the parameters (each
# moment as its parameter, counts replicated): checked at the boundary by key
# path, and the shardings `jit` is given, with no annotation of its own. Spelt
# `" params"`: a linter reads a bare name in a string annotation as a forward
# reference (the spaces are dropped).
@jts.jit(in_shardings="annotations", out_shardings="annotations")
def train_step(
    params: Transformer, opt_state: jts.Like[" params"], batch: Batch
) -> tuple[Transformer, jts.Like[" params"], Scalar]:
    if deferred_reduction(params):
        loss, grads = accumulate_unreduced(params, batch)
    else:
        loss, grads = accumulate(params, batch)
    loss, grads = jax.tree.map(lambda x: x / MICRO, (loss, grads))
    jts.check_tree(grads, name="grads")  # laid out as the parameters
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make_mesh(shape=(4, 2), axis_type: str = "explicit", devices=None):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
    if devices is None:
        devices = jax.devices()[: math.prod(shape)]  # a smaller mesh: the first
    return jax.make_mesh(
        shape, ("data", "model"), axis_types=(kind,) * 2, devices=devices
    )


def synthetic(step: int, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a step: sequences that repeat a short pattern."""
    rng = np.random.default_rng(step)
    period = rng.integers(2, 5, size=(config.batch, 1))
    start = rng.integers(0, config.vocab, size=(config.batch, 1))
    position = np.arange(config.seq + 1)
    data = (start + (position % period) * 7) % config.vocab
    return data[:, :-1].astype(np.int32), data[:, 1:].astype(np.int32)


def load_batch(step: int, config: Config, mesh) -> Batch:
    """This process's rows of the global batch, placed as the step's annotation says."""
    tokens, labels = synthetic(step, config)
    rows = jts.local_rows(Tokens, tokens.shape, mesh)
    local = Batch(tokens[rows], labels[rows])
    return jts.place_for(train_step, "batch", local, mesh)


def init_state(key, config: Config) -> tuple[Transformer, optax.OptState]:
    """The training state, as a restore target takes its shapes and layout from."""
    params = Transformer(key, config)
    return params, optimizer.init(params)


def init(config: Config, mesh, seed: int = 0) -> tuple[Transformer, optax.OptState]:
    """Parameters and optimiser state, each array created in its own shards."""
    # RBG keys: the same numbers however the result is sharded (checked by the
    # loss tests), and on CPU about 4x cheaper to compile than threefry.
    key = jax.random.key(seed, impl="rbg")
    params = jts.sharded_init(Transformer, key, config, mesh=mesh)
    # Each moment created in its parameter's shards.
    opt_state = jts.sharded_init(optimizer.init, params, mesh=mesh)
    return params, opt_state


def train(
    layout: str = "fsdp_tp",
    axis_type: str = "explicit",
    steps: int = 3,
    config: Config = Config(),
    mesh_shape=(4, 2),
    devices=None,
) -> list[float]:
    """Trains for `steps` steps from a fresh initialisation; the loss of each."""
    return run(layout, axis_type, steps, config, mesh_shape, devices)[0]


def run(
    layout: str = "fsdp_tp",
    axis_type: str = "explicit",
    steps: int = 3,
    config: Config = Config(),
    mesh_shape=(4, 2),
    devices=None,
    state=None,
    first: int = 0,
) -> tuple[list[float], tuple]:
    """Trains for `steps` steps from step `first`, from `state` (laid out for this
    layout) or a fresh initialisation; the loss of each, and the state reached."""
    mesh = make_mesh(mesh_shape, axis_type, devices)
    with jax.set_mesh(mesh), jts.axis_rules(RULES[layout]):
        params, opt_state = state if state is not None else init(config, mesh)
        losses = []
        for step in range(first, first + steps):
            batch = load_batch(step, config, mesh)
            params, opt_state, loss = train_step(params, opt_state, batch)
            losses.append(float(np.asarray(loss.addressable_data(0))))
    return losses, (params, opt_state)
