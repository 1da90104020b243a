"""A training step written the way public pure-JAX LLM codebases write one.

Weights are plain dataclasses registered as pytrees, every field annotated once
with logical axis names (`jts.Logical`, resolved through `RULES`); the
projections are `jnp.einsum(..., out_sharding=...)` on an Explicit mesh (a
`jax.lax.with_sharding_constraint` after a plain einsum on an Auto mesh, where
`out_sharding=` needs Explicit axes); attention runs under
`jax.sharding.auto_axes` (on an Explicit mesh; an Auto mesh is Auto already);
the update is optax's AdamW. Tiny sizes: a step of a few milliseconds on 8 CPU
devices, scaled by the batch. Nothing here is the project's own model code.

Leaves: 9 a layer plus 3 (embedding, final norm, unembedding): 3 layers are 30
parameter leaves, 10 are 93, 33 are 300; the step's arguments hold three times
that (parameters, AdamW's two moments) plus AdamW's count and the batch.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int


L = jts.Logical
RULES = {
    "batch": "data",
    "seq": None,
    "embed": None,
    "heads": "model",
    "hd": None,
    "mlp": "model",
    "vocab": "model",
    "norm": None,
}

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, SEQ = 64, 32, 4, 8, 64, 8


Norm = Float[Array, "embed", L("norm")]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    ln1: Norm
    wq: Float[Array, "embed heads hd", L]
    wk: Float[Array, "embed heads hd", L]
    wv: Float[Array, "embed heads hd", L]
    wo: Float[Array, "heads hd embed", L]
    ln2: Norm
    w_gate: Float[Array, "embed mlp", L]
    w_up: Float[Array, "embed mlp", L]
    w_down: Float[Array, "mlp embed", L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: Float[Array, "vocab embed", L]
    layers: list[Layer]
    ln_f: Norm
    unembed: Float[Array, "embed vocab", L]


def leaves_for(layers: int) -> int:
    """Parameter leaves of a model of `layers` layers."""
    return 9 * layers + 3


def make_mesh(kind: str) -> Any:
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)


def _explicit(mesh: Any) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def _mm(eq: str, a: Any, b: Any, spec: P, explicit: bool) -> Any:
    if explicit:
        return jnp.einsum(eq, a, b, out_sharding=spec)
    return jax.lax.with_sharding_constraint(jnp.einsum(eq, a, b), spec)


def _rms(x: Any, scale: Any) -> Any:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention_core(q: Any, k: Any, v: Any) -> Any:
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("bhst,bthd->bshd", weights, v)


HEADS_SPEC = P("data", None, "model", None)
HIDDEN_SPEC = P("data", None, None)
MLP_SPEC = P("data", None, "model")
LOGITS_SPEC = P("data", None, "model")


def forward(w: Weights, tokens: Any, explicit: bool) -> Any:
    x = (
        w.embed.at[tokens].get(out_sharding=HIDDEN_SPEC)
        if explicit
        else w.embed[tokens]
    )
    if explicit:
        core = jax.sharding.auto_axes(_attention_core, out_sharding=HEADS_SPEC)
    else:
        core = _attention_core
    for layer in w.layers:
        h = _rms(x, layer.ln1)
        q = _mm("bse,ehd->bshd", h, layer.wq, HEADS_SPEC, explicit)
        k = _mm("bse,ehd->bshd", h, layer.wk, HEADS_SPEC, explicit)
        v = _mm("bse,ehd->bshd", h, layer.wv, HEADS_SPEC, explicit)
        attn = core(q, k, v)
        x = x + _mm("bshd,hde->bse", attn, layer.wo, HIDDEN_SPEC, explicit)
        h = _rms(x, layer.ln2)
        gate = _mm("bse,em->bsm", h, layer.w_gate, MLP_SPEC, explicit)
        up = _mm("bse,em->bsm", h, layer.w_up, MLP_SPEC, explicit)
        x = x + _mm(
            "bsm,me->bse", jax.nn.silu(gate) * up, layer.w_down, HIDDEN_SPEC, explicit
        )
    return _mm("bse,ev->bsv", _rms(x, w.ln_f), w.unembed, LOGITS_SPEC, explicit)


# The logical axes of each field, as the field's codebases write them beside
# the annotations (the mesh spec of each comes from `RULES`).
AXES = {
    "ln1": ("norm",),
    "ln2": ("norm",),
    "ln_f": ("norm",),
    "wq": ("embed", "heads", "hd"),
    "wk": ("embed", "heads", "hd"),
    "wv": ("embed", "heads", "hd"),
    "wo": ("heads", "hd", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "embed": ("vocab", "embed"),
    "unembed": ("embed", "vocab"),
}
SHAPES = {
    "ln1": (EMBED,),
    "ln2": (EMBED,),
    "ln_f": (EMBED,),
    "wq": (EMBED, HEADS, HEAD_DIM),
    "wk": (EMBED, HEADS, HEAD_DIM),
    "wv": (EMBED, HEADS, HEAD_DIM),
    "wo": (HEADS, HEAD_DIM, EMBED),
    "w_gate": (EMBED, MLP),
    "w_up": (EMBED, MLP),
    "w_down": (MLP, EMBED),
    "embed": (VOCAB, EMBED),
    "unembed": (EMBED, VOCAB),
}


def spec(name: str) -> P:
    return P(*(RULES[axis] for axis in AXES[name]))


def init(layers: int, mesh: Any, seed: int = 0) -> Weights:
    """Weights placed as their logical axes say (`RULES`)."""
    key = iter(jax.random.split(jax.random.key(seed), 9 * layers + 3))

    def leaf(name: str) -> Any:
        shape = SHAPES[name]
        if name.startswith("ln"):
            value = jnp.ones(shape)
        else:
            value = jax.random.normal(next(key), shape) * shape[0] ** -0.5
        return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec(name)))

    def layer() -> Layer:
        return Layer(**{f.name: leaf(f.name) for f in dataclasses.fields(Layer)})

    return Weights(
        leaf("embed"), [layer() for _ in range(layers)], leaf("ln_f"), leaf("unembed")
    )


def batch(size: int, mesh: Any, seed: int = 1) -> Any:
    tokens = jax.random.randint(jax.random.key(seed), (size, SEQ + 1), 0, VOCAB)
    return jax.device_put(tokens, jax.sharding.NamedSharding(mesh, P("data", None)))


OPTIMIZER = optax.adamw(1e-3)


def opt_init(w: Weights) -> Any:
    """AdamW's state, its moments placed as the weights (as the field's
    codebases do, with the optimizer state's shardings from the weights')."""
    shardings = jax.tree.map(lambda x: x.sharding, w)

    def place(state: Any) -> Any:
        if isinstance(state, optax.ScaleByAdamState):
            mu, nu = jax.device_put((state.mu, state.nu), (shardings, shardings))
            return state._replace(mu=mu, nu=nu)
        return state

    return tuple(place(s) for s in OPTIMIZER.init(w))


Tokens = Int[Array, "batch seq", L]


def make_step(explicit: bool) -> Any:
    """The step: loss, gradient, AdamW update; weights in, weights out."""

    def loss_fn(w: Weights, tokens: Any) -> Any:
        logits = forward(w, tokens[:, :-1], explicit)
        labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

    def train_step(
        w: Weights, opt_state: Any, tokens: Tokens
    ) -> tuple[Weights, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(w, tokens)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss

    return train_step
