"""The training program: data, the step, the loop.

Parameters are created by `jts.sharded_init`, batches placed by `jts.place`, the
step compiled by `jts.jit` with its shardings read off its signature; checks are
on throughout. No `PartitionSpec` or `NamedSharding` is written here.
"""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType

import jaxtyping_shard as jts

from .layout import RULES
from .model import Config, cross_entropy, Scalar, Tokens, Transformer
from .optim import AdamState, adamw_init, adamw_update


class Batch(eqx.Module):
    tokens: Tokens
    labels: Tokens


def loss_fn(params: Transformer, batch: Batch) -> Scalar:
    # A no-op going forward; its gradient comes back laid out as the parameters
    # (on Auto meshes XLA would otherwise keep it gathered, as the matmuls use it).
    params = jts.reshard(params)
    return cross_entropy(params(batch.tokens), batch.labels)


@jts.jit(in_shardings="annotations", out_shardings="annotations")
def train_step(
    params: Transformer, opt: AdamState, batch: Batch
) -> tuple[Transformer, AdamState, Scalar]:
    loss, grads = eqx.filter_value_and_grad(loss_fn)(params, batch)
    jts.check_tree(grads, name="grads")  # laid out as the parameters
    params, opt = adamw_update(params, grads, opt)
    return params, opt, loss


def make_mesh(shape=(4, 2), axis_type: str = "explicit", devices=None):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
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


def init(config: Config, mesh, seed: int = 0) -> tuple[Transformer, AdamState]:
    # RBG keys: the same numbers however the result is sharded (checked by the
    # loss tests), and on CPU about 4x cheaper to compile than threefry.
    key = jax.random.key(seed, impl="rbg")
    params = jts.sharded_init(Transformer, key, config, mesh=mesh)
    # The moments take only the parameters' shapes; each is created in its shards.
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    opt = jts.sharded_init(adamw_init, shapes, mesh=mesh)
    return params, opt


def train(
    layout: str = "fsdp_tp",
    axis_type: str = "explicit",
    steps: int = 3,
    config: Config = Config(),
    mesh_shape=(4, 2),
    devices=None,
) -> list[float]:
    """Trains for `steps` steps; returns the loss of each."""
    mesh = make_mesh(mesh_shape, axis_type, devices)
    with jax.set_mesh(mesh), jts.axis_rules(RULES[layout]):
        params, opt = init(config, mesh)
        losses = []
        for step in range(steps):
            params, opt, loss = train_step(params, opt, load_batch(step, config, mesh))
            losses.append(float(np.asarray(loss.addressable_data(0))))
    return losses
