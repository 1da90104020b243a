"""A transformer too large for one device's budget, created sharded.

The model's parameters take 64 MiB unsharded. Say each device may spend at most
BUDGET = 16 MiB on them (a stand-in for a GPU's memory): no device can build the
model and then shard it. `jts.sharded_init` builds it from the shardings its
annotations declare, each device creating only its own shards, and the stacked
layers (`eqx.filter_vmap`) declare their extra leading dim with `stacked=`.
Run: `python examples/sharded_init.py` (8 CPU devices).
"""

import os


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Int, jaxtyped  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard import Float  # noqa: E402


VOCAB, EMBED, MLP, LAYERS = 4096, 512, 2048, 4
BUDGET = 16 * 2**20  # bytes of parameters one device may hold


@jaxtyped(typechecker=beartype)
class Block(eqx.Module):
    qkv: Float[Array, "embed three_embed", P("data", "model")]
    out: Float[Array, "embed embed2", P("model", "data")]
    w_in: Float[Array, "embed mlp", P("data", "model")]
    w_out: Float[Array, "mlp embed", P("model", "data")]


def make_block(key):
    k = jax.random.split(key, 4)
    scale = EMBED**-0.5
    return Block(
        jax.random.normal(k[0], (EMBED, 3 * EMBED)) * scale,
        jax.random.normal(k[1], (EMBED, EMBED)) * scale,
        jax.random.normal(k[2], (EMBED, MLP)) * scale,
        jax.random.normal(k[3], (MLP, EMBED)) * MLP**-0.5,
    )


@jaxtyped(typechecker=beartype)
class Transformer(eqx.Module):
    embed: Float[Array, "vocab embed", P("model", "data")]
    blocks: Block  # LAYERS blocks stacked on a leading dim
    unembed: Float[Array, "embed vocab", P("data", "model")]

    def __init__(self, key):
        k_embed, k_blocks, k_un = jax.random.split(key, 3)
        self.embed = jax.random.normal(k_embed, (VOCAB, EMBED))
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, LAYERS))
        self.unembed = jax.random.normal(k_un, (EMBED, VOCAB)) * EMBED**-0.5

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = self.embed[tokens]

        def layer(x, block):
            q, k, v = jnp.split(x @ block.qkv, 3, axis=-1)
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            att = jnp.where(mask, q @ k.T / EMBED**0.5, -jnp.inf)
            x = x + jax.nn.softmax(att, axis=-1) @ v @ block.out
            return x + jax.nn.gelu(x @ block.w_in) @ block.w_out, None

        x, _ = jax.lax.scan(layer, x, self.blocks)
        return x @ self.unembed


def main() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    key = jax.random.key(0)

    shapes = jts.abstract(Transformer, key, mesh=mesh, stacked={"blocks/**": 1})
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert total > BUDGET, "the example's model must not fit one device's budget"

    model = jts.sharded_init(Transformer, key, mesh=mesh, stacked={"blocks/**": 1})
    assert model.blocks.w_in.sharding.spec == P(None, "data", "model")

    per_device: dict = {}
    for leaf in jax.tree.leaves(model):
        for shard in leaf.addressable_shards:
            size = shard.data.size * shard.data.dtype.itemsize
            per_device[shard.device] = per_device.get(shard.device, 0) + size
    most = max(per_device.values())
    assert most <= BUDGET, most
    # The table computed from the annotations alone says the same.
    report = jts.explain(model, mesh, stacked={"blocks/**": 1})
    assert report.bytes_per_device == most, (report.bytes_per_device, most)
    print(report)

    # A forward pass; XLA chooses the activations' layout (Auto axes).
    forward = jax.sharding.auto_axes(lambda m, t: m(t), out_sharding=P())
    with jax.set_mesh(mesh):
        logits = jax.jit(forward)(model, jnp.arange(16))
    assert logits.shape == (16, VOCAB) and bool(jnp.isfinite(logits).all())

    print(
        f"{total / 2**20:.0f} MiB of parameters, at most {most / 2**20:.0f} MiB on "
        f"any device (budget {BUDGET / 2**20:.0f} MiB); specs: "
        f"blocks.w_in {model.blocks.w_in.sharding.spec}, "
        f"embed {model.embed.sharding.spec}"
    )


if __name__ == "__main__":
    main()
