"""A quantised LLM's weights, written the way a public pure-JAX LLM codebase
writes them: weights as dataclasses whose fields say their logical axes, a rules
dataclass in the config, int8 weights with per-channel scales (some kept as
size-1 dims, some dropped), and its own sharding plumbing (`spec_of_axes`), the
oracle the tests compare the library with.

The only annotations are the field hints such a codebase writes anyway: a weight
is `Float[Array, "embed mlp", jts.Logical] | QuantArray`, and `QuantArray` says
once that its leaves follow the field (`jts.FollowsField`).
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    quant: Int8[Array, "...", jts.FollowsField]
    scale: Float[Array, "...", jts.FollowsField]
    # Which dims of the weight the scale dropped (static: not a leaf).
    scale_dropped: tuple = dataclasses.field(default=(), metadata=dict(static=True))


L = jts.Logical


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Attention:
    q: Float[Array, "embed q_heads head_dim", L] | QuantArray
    k: Float[Array, "embed kv_heads head_dim", L] | QuantArray
    v: Float[Array, "embed kv_heads head_dim", L] | QuantArray
    o: Float[Array, "q_heads head_dim embed", L] | QuantArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mlp:
    gate: Float[Array, "embed mlp", L] | QuantArray
    up: Float[Array, "embed mlp", L] | QuantArray
    down: Optional[Float[Array, "mlp embed", L] | QuantArray]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn: Attention
    mlp: Mlp
    attn_norm: Float[Array, " embed", L]
    mlp_norm: Float[Array, " embed", L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embedding: Float[Array, "vocab embed", L]
    layers: list[Layer]
    final_norm: Float[Array, " embed", L]
    lm_head: Float[Array, "embed vocab", L] | QuantArray | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The config's rules: logical name -> mesh axis (None: replicated)."""

    batch: Optional[str] = "data"
    seq: Optional[str] = None
    vocab: Optional[str] = "model"
    embed: Optional[str] = "data"
    q_heads: Optional[str] = "model"
    kv_heads: Optional[str] = "model"
    head_dim: Optional[str] = None
    mlp: Optional[str] = "model"


RULES = ShardingRules()
SIZES = dict(vocab=16, embed=8, q_heads=4, kv_heads=2, head_dim=4, mlp=8)
# Each weight: its logical axes and the axes it is quantised along (the
# contraction), the scale keeping them as size-1 dims (`keepdims`) or not.
AXES = {
    "q": (("embed", "q_heads", "head_dim"), (0,), True),
    "k": (("embed", "kv_heads", "head_dim"), (0,), False),
    "v": (("embed", "kv_heads", "head_dim"), (0,), True),
    "o": (("q_heads", "head_dim", "embed"), (0, 1), False),
    "gate": (("embed", "mlp"), (0,), True),
    "up": (("embed", "mlp"), (0,), False),
    "down": (("mlp", "embed"), (0,), True),
    "lm_head": (("embed", "vocab"), (0,), False),
}
N_LAYERS = 3


def spec_of_axes(axes: tuple, rules: ShardingRules = RULES) -> P:
    """The codebase's own plumbing: logical axes to a PartitionSpec."""
    return P(*(None if a is None else getattr(rules, a) for a in axes))


def quantize(w: jax.Array, axis: tuple, keepdims: bool) -> QuantArray:
    scale = jnp.max(jnp.abs(w), axis=axis, keepdims=True) / 127.0 + 1e-6
    quant = jnp.round(w / scale).astype(jnp.int8)
    if not keepdims:
        scale = jnp.squeeze(scale, axis)
    return QuantArray(quant, scale, () if keepdims else axis)


def scale_axes(axes: tuple, axis: tuple, keepdims: bool) -> tuple:
    """The codebase's rule for a scale: the weight's axes without the quantised
    ones (`None` in their place when kept as size-1 dims)."""
    if keepdims:
        return tuple(None if i in axis else a for i, a in enumerate(axes))
    return tuple(a for i, a in enumerate(axes) if i not in axis)


def _weight(key, name: str, mesh, quantised: bool):
    axes, axis, keepdims = AXES[name]
    w = jax.random.normal(key, tuple(SIZES[a] for a in axes))
    put = lambda x, names: _placed(x, mesh, names)  # noqa: E731
    if not quantised:
        return put(w, axes)
    q = quantize(w, axis, keepdims)
    return QuantArray(
        put(q.quant, axes),
        put(q.scale, scale_axes(axes, axis, keepdims)),
        q.scale_dropped,
    )


def _placed(x: jax.Array, mesh, names: tuple) -> jax.Array:
    if mesh is None:
        return x
    return jax.device_put(x, NamedSharding(mesh, spec_of_axes(names)))


def build(mesh, quantised=lambda name, layer: True) -> Weights:
    """The model, placed by the codebase's own plumbing (not placed when `mesh`
    is None: an init function); `quantised(name, layer)` says which weights are
    int8 (the others stay float)."""
    keys = iter(jax.random.split(jax.random.key(0), 64))

    def put(x, *names):
        return _placed(x, mesh, names)

    def w(name, layer=None):
        return _weight(next(keys), name, mesh, quantised(name, layer))

    layers = [
        Layer(
            Attention(w("q", i), w("k", i), w("v", i), w("o", i)),
            Mlp(w("gate", i), w("up", i), w("down", i)),
            put(jnp.ones((SIZES["embed"],)), "embed"),
            put(jnp.ones((SIZES["embed"],)), "embed"),
        )
        for i in range(N_LAYERS)
    ]
    embedding = put(jnp.ones((SIZES["vocab"], SIZES["embed"])), "vocab", "embed")
    final = put(jnp.ones((SIZES["embed"],)), "embed")
    return Weights(embedding, layers, final, w("lm_head"))


def leaf_count(weights: Weights) -> int:
    return len(jax.tree_util.tree_leaves(weights))


def dequantize(w) -> jax.Array:
    if not isinstance(w, QuantArray):
        return w
    scale = w.scale
    if w.scale_dropped:
        scale = jnp.expand_dims(scale, w.scale_dropped)
    return w.quant.astype(jnp.float32) * scale


def total(weights: Weights) -> jax.Array:
    """A step over every weight (dequantised): what the jit boundary traces."""
    out = jnp.float32(0)
    for leaf in jax.tree_util.tree_leaves(
        weights, is_leaf=lambda x: isinstance(x, QuantArray)
    ):
        out = out + jnp.sum(dequantize(leaf) ** 2)
    return out
