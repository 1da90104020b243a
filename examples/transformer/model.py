"""The model: a decoder-only transformer in Equinox, every array annotated once.

Dims carry *logical* names (`jts.Logical`); the rules table in `layout.py` maps
them to mesh axes, so the same annotations give data parallelism, FSDP or
FSDP + tensor parallelism. Each parameter is annotated once, as stored (split
over FSDP and tensor parallelism); a computation takes it *as used*
(`jts.as_used`, `jts.Used[...]`: its FSDP names gathered, as the rules'
`jts.fsdp` entries say), and a contraction over a split dim gets its result
layout from its operands (`jts.einsum`). The activations (`Hidden`, `Heads`,
...) are checked at every function boundary.
"""

import dataclasses
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int


L = jts.Logical
checked = jts.jaxtyped(typechecker=beartype)

# Parameters, as stored.
Embedding = Float[Array, "vocab embed", L]
QKV = Float[Array, "embed heads hd", L("embed", "heads", None)]
Out = Float[Array, "heads hd embed", L("heads", None, "embed")]
MlpIn = Float[Array, "embed mlp", L]
MlpOut = Float[Array, "mlp embed", L]
Scale = Float[Array, "embed", L("norm")]
Unembedding = Float[Array, "embed vocab", L]
# Activations.
Tokens = Int[Array, "batch seq", L]
Hidden = Float[Array, "batch seq embed", L]
Heads = Float[Array, "batch seq heads hd", L("batch", "seq", "heads", None)]
MlpHidden = Float[Array, "batch seq mlp", L]
Logits = Float[Array, "batch seq vocab", L]
Scalar = Float[Array, "", L]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    embed: int = 32
    heads: int = 4
    head_dim: int = 8
    mlp: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 16
    # Rematerialisation of the scanned layers: a `jax.checkpoint_policies` name
    # (what the backward pass keeps of each layer; the rest is recomputed), or
    # None: every layer's activations kept for the backward pass.
    remat: Optional[str] = None


def _normal(key, shape, fan_in):
    return jax.random.normal(key, shape) * fan_in**-0.5


@checked
def layer_norm(x: Hidden, scale: Scale) -> Hidden:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


@checked
def attend(q: Heads, k: Heads, v: Heads) -> Heads:
    """Causal attention of each head (heads split for tensor parallelism)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(eqx.Module):
    wq: QKV
    wk: QKV
    wv: QKV
    wo: Out

    def __init__(self, key, config: Config):
        kq, kk, kv, ko = jax.random.split(key, 4)
        shape = (config.embed, config.heads, config.head_dim)
        self.wq = _normal(kq, shape, config.embed)
        self.wk = _normal(kk, shape, config.embed)
        self.wv = _normal(kv, shape, config.embed)
        out = (config.heads, config.head_dim, config.embed)
        self.wo = _normal(ko, out, config.heads * config.head_dim)

    @checked
    def __call__(self, x: Hidden) -> Hidden:
        attn = jts.as_used(self)  # the FSDP all-gathers
        q = project(x, attn.wq)
        k = project(x, attn.wk)
        v = project(x, attn.wv)
        return mix(attend(q, k, v), attn.wo)


@checked
def project(x: Hidden, w: jts.Used[QKV]) -> Heads:
    """A column-parallel matmul: each device computes its own heads."""
    return jnp.einsum("bse,ehd->bshd", x, w)


@checked
def mix(heads: Heads, wo: jts.Used[Out]) -> Hidden:
    """The row-parallel matmul: partial sums over the heads, summed over `model`."""
    return jts.einsum("bshd,hde->bse", heads, wo)


class Mlp(eqx.Module):
    w_in: MlpIn
    w_out: MlpOut

    def __init__(self, key, config: Config):
        k_in, k_out = jax.random.split(key)
        self.w_in = _normal(k_in, (config.embed, config.mlp), config.embed)
        self.w_out = _normal(k_out, (config.mlp, config.embed), config.mlp)

    @checked
    def __call__(self, x: Hidden) -> Hidden:
        mlp = jts.as_used(self)
        h = jax.nn.gelu(up(x, mlp.w_in))
        return down(h, mlp.w_out)


@checked
def up(x: Hidden, w_in: jts.Used[MlpIn]) -> MlpHidden:
    """The column-parallel matmul: its result stays split over `mlp`."""
    return jnp.einsum("bse,em->bsm", x, w_in)


@checked
def down(h: MlpHidden, w_out: jts.Used[MlpOut]) -> Hidden:
    """The row-parallel matmul: partial sums over `mlp`, summed over `model`."""
    return jts.einsum("bsm,me->bse", h, w_out)


class Block(eqx.Module):
    ln1: Scale
    attn: Attention
    ln2: Scale
    mlp: Mlp

    def __init__(self, key, config: Config):
        k_attn, k_mlp = jax.random.split(key)
        self.ln1 = jnp.ones(config.embed)
        self.attn = Attention(k_attn, config)
        self.ln2 = jnp.ones(config.embed)
        self.mlp = Mlp(k_mlp, config)

    @checked
    def __call__(self, x: Hidden) -> Hidden:
        x = x + self.attn(layer_norm(x, self.ln1))
        return x + self.mlp(layer_norm(x, self.ln2))


class Transformer(eqx.Module):
    embed: Embedding
    # The layers stacked: each leaf of a `Block` with one leading dim (the layer),
    # declared here once for every function that reads the annotations.
    blocks: jts.Stacked[Block]
    ln_f: Scale
    unembed: Unembedding
    remat: Optional[str] = eqx.field(static=True)  # `Config.remat`

    def __init__(self, key, config: Config):
        k_embed, k_blocks, k_un = jax.random.split(key, 3)
        self.embed = jax.random.normal(k_embed, (config.vocab, config.embed))
        keys = jax.random.split(k_blocks, config.layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(k, config))(keys)
        self.ln_f = jnp.ones(config.embed)
        self.unembed = _normal(k_un, (config.embed, config.vocab), config.embed)
        self.remat = config.remat

    @checked
    def __call__(self, tokens: Tokens) -> Logits:
        x = lookup(tokens, jts.as_used(self.embed, Embedding))
        # One layer at a time: a scan over the stacked layers compiles one block.
        if self.remat is None:
            x, _ = jax.lax.scan(lambda x, block: (block(x), None), x, self.blocks)
        else:  # `Config.remat`: the layers rematerialised in the backward pass
            x, _ = jax.lax.scan(_layer(self.remat), x, self.blocks)
        x = layer_norm(x, self.ln_f)
        # Column-parallel: the logits stay split over the vocabulary.
        unembed = jts.as_used(self.unembed, Unembedding)
        return jnp.einsum("bse,ev->bsv", x, unembed)


def _layer(remat: Optional[str]):
    """The scan's body: one block; under `remat`, rematerialised in the backward
    pass, which then keeps only what the policy saves (the matmuls' outputs for
    `dots_with_no_batch_dims_saveable`) and recomputes the rest."""

    def layer(x, block):
        return block(x), None

    if remat is None:
        return layer
    policy = getattr(jax.checkpoint_policies, remat)
    return jax.checkpoint(layer, policy=policy, prevent_cse=False)


@checked
def lookup(tokens: Tokens, table: jts.Used[Embedding]) -> Hidden:
    """A vocabulary-parallel lookup: each device's rows of the table, summed."""
    one_hot = jts.reshard(jax.nn.one_hot(tokens, table.shape[0]), Logits)
    return jts.einsum("bsv,ve->bse", one_hot, table)


@checked
def cross_entropy(logits: Logits, labels: Tokens) -> Scalar:
    """The mean next-token loss; the vocabulary may be split over devices."""
    targets = jts.reshard(jax.nn.one_hot(labels, logits.shape[-1]), Logits)
    picked = (logits * targets).sum(-1)
    return (jax.nn.logsumexp(logits, axis=-1) - picked).mean()
