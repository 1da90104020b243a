"""A small Flax Linen LM in MaxText's style, checked by the layout it already wrote.

Every parameter is boxed by `nn.with_logical_partitioning` in logical names, the
activations are pinned by `nn.with_logical_constraint`, and one rules table in
the config (`Config.logical_axis_rules`, Linen's list of pairs) maps the names to
the mesh, for Linen and for jaxtyping_shard alike (`jts.axis_rules(
nn.get_logical_axis_rules())`: the same table, not a copy). No annotation is
added for the parameters or the optimiser state: `jts.jit` reads their boxes on
the way in and out of the step, `jts.preflight` counts them by their boxes, and
`jts.collectives` holds the step to `linen_lm_collectives.json`. Run:
`python examples/linen_lm.py` (8 CPU devices), or `python examples/linen_lm.py
--update` to rewrite this JAX release's baseline. The step runs on an Auto mesh,
as MaxText runs: on Explicit axes Linen's `nn.with_logical_constraint` is an
assertion (`with_sharding_constraint`) that JAX's sharding-in-types refuses here;
the state is checked by its boxes on an Explicit mesh too (`check_state`).
"""

import os
import sys


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard import Int  # noqa: E402


BASELINE = Path(__file__).with_name("linen_lm_collectives.json")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    embed: int = 32
    heads: int = 4
    head_dim: int = 8
    mlp: int = 64
    layers: int = 2
    batch: int = 8
    seq: int = 16
    # MaxText's form: (logical name, mesh axes), FSDP over `data` + TP over `model`.
    logical_axis_rules: tuple = (
        ("activation_batch", "data"),
        ("activation_length", None),
        ("activation_embed", None),
        ("activation_heads", "model"),
        ("activation_kv", None),
        ("activation_mlp", "model"),
        ("activation_vocab", "model"),
        ("embed", "data"),
        ("vocab", "model"),
        ("heads", "model"),
        ("kv", None),
        ("mlp", "model"),
        ("norm", None),
    )


def boxed(init, *names):
    return nn.with_logical_partitioning(init, names)


normal = nn.initializers.normal(0.02)
BSE = ("activation_batch", "activation_length", "activation_embed")


class Embed(nn.Module):
    """The token table, looked up by a one-hot matmul (MaxText's
    `use_iota_embed`): a matmul XLA partitions over both of the table's axes."""

    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        table = self.param(
            "embedding", boxed(normal, "vocab", "embed"), (c.vocab, c.embed)
        )
        one_hot = jax.nn.one_hot(tokens, c.vocab, dtype=table.dtype)
        one_hot = nn.with_logical_constraint(one_hot, (*BSE[:2], "activation_vocab"))
        return nn.with_logical_constraint(
            jnp.einsum("bsv,ve->bse", one_hot, table), BSE
        )


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        heads = (
            "activation_batch",
            "activation_length",
            "activation_heads",
            "activation_kv",
        )

        # `self.param` + einsum, as MaxText's own DenseGeneral: `nn.DenseGeneral`
        # unboxes its kernel flat (rank 2) under the rules, before reshaping it.
        def project(name):
            w = self.param(
                name,
                boxed(normal, "embed", "heads", "kv"),
                (c.embed, c.heads, c.head_dim),
            )
            return nn.with_logical_constraint(jnp.einsum("bse,ehd->bshd", x, w), heads)

        q, k, v = project("query"), project("key"), project("value")
        scores = jnp.einsum("bshd,bthd->bhst", q, k) / c.head_dim**0.5
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        o = nn.with_logical_constraint(jnp.einsum("bhst,bthd->bshd", weights, v), heads)
        w = self.param(
            "out", boxed(normal, "heads", "kv", "embed"), (c.heads, c.head_dim, c.embed)
        )
        out = jnp.einsum("bshd,hde->bse", o, w)
        return nn.with_logical_constraint(out, BSE)


class Mlp(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        kernel = boxed(normal, "embed", "mlp")
        h = nn.gelu(nn.Dense(c.mlp, use_bias=False, kernel_init=kernel, name="wi")(x))
        h = nn.with_logical_constraint(h, (*BSE[:2], "activation_mlp"))
        kernel = boxed(normal, "mlp", "embed")
        out = nn.Dense(c.embed, use_bias=False, kernel_init=kernel, name="wo")(h)
        return nn.with_logical_constraint(out, BSE)


class Decoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        scale = boxed(nn.initializers.ones, "norm")
        x = x + Attention(self.config)(nn.RMSNorm(scale_init=scale, name="pre_attn")(x))
        return x + Mlp(self.config)(nn.RMSNorm(scale_init=scale, name="pre_mlp")(x))


class Transformer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = Embed(c, name="token_embedder")(tokens)
        for i in range(c.layers):
            x = Decoder(c, name=f"layers_{i}")(x)
        x = nn.RMSNorm(
            scale_init=boxed(nn.initializers.ones, "norm"), name="final_norm"
        )(x)
        logits = nn.Dense(c.vocab, use_bias=False, name="logits",
                          kernel_init=boxed(normal, "embed", "vocab"))(x)  # fmt: skip
        return nn.with_logical_constraint(logits, (*BSE[:2], "activation_vocab"))


Tokens = Int[Array, "batch seq", P("data", None)]
CONFIG = Config()
model = Transformer(CONFIG)
tx = optax.adamw(1e-2, weight_decay=0.1)


@jts.jit
@jts.jaxtyped(typechecker=beartype)  # checks the hinted batch
def train_step(params, opt_state, tokens: Tokens):
    def loss_fn(params):
        logits = model.apply(params, tokens[:, :-1])
        labels = tokens[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make_mesh(kind="auto"):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)


def rules(config=CONFIG):
    """Linen's rules context and this library's, one table."""
    stack = contextlib.ExitStack()
    stack.enter_context(nn.logical_axis_rules(list(config.logical_axis_rules)))
    stack.enter_context(jts.axis_rules(nn.get_logical_axis_rules()))
    return stack


def init_state(key, mesh):
    tokens = jnp.zeros((CONFIG.batch, CONFIG.seq - 1), jnp.int32)
    params = jts.sharded_init(model.init, key, tokens, mesh=mesh)
    return params, tx.init(params)


def load_batch(step, mesh):
    data = jax.random.randint(
        jax.random.key(step), (CONFIG.batch, CONFIG.seq), 0, CONFIG.vocab
    )
    return jts.place(data, Tokens, mesh)


def train(kind="auto", steps=3):
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh), rules():
        params, opt_state = init_state(jax.random.key(0), mesh)
        losses = []
        batch = load_batch(0, mesh)  # one batch, learnt: the loss must fall
        for _ in range(steps):
            params, opt_state, loss = train_step(params, opt_state, batch)
            losses.append(float(loss))
        return losses


def abstract_inputs(mesh):
    """The step's arguments as `init_state` and `load_batch` make them, abstract."""
    return jax.eval_shape(
        lambda: (*init_state(jax.random.key(0), mesh), load_batch(0, mesh))
    )


def preflight(kind="auto"):
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh), rules():
        return jts.preflight(train_step, *abstract_inputs(mesh), mesh=mesh)


def collectives(kind="auto"):
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh), rules():
        return jts.collectives(train_step, *abstract_inputs(mesh))


def check_state(kind="explicit"):
    """The initial state checked by its boxes, on either mesh kind."""
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh), rules():
        params, opt_state = init_state(jax.random.key(0), mesh)
        return jts.check_tree((params, opt_state), name="state", summary=True)


if __name__ == "__main__":
    losses = train("auto")
    assert losses[-1] < losses[0], losses
    print(f"auto: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(preflight("auto"))
    report = collectives("auto")
    print(report)
    report.check(BASELINE, update="--update" in sys.argv[1:])
    print(f"explicit: {check_state('explicit')}")
