"""A small Flax NNX transformer, FSDP + TP, its layout written once as NNX metadata.

Every parameter's layout is `nnx.with_partitioning` / `out_sharding` metadata in
logical names; one rules table (`RULES`) maps them to the mesh, for Flax's eager
sharding (`nnx.logical_axis_rules(jts.flax_rules())`) and for jaxtyping_shard
alike. jaxtyping_shard creates the model in place (`jts.sharded_init`), checks
the model, the optax state inside `nnx.Optimizer` and the gradients against the
metadata on every step (`jts.check_tree` inside `nnx.jit`), and the activations
against the annotations of the functions that make them. Run:
`python examples/nnx_transformer.py` (8 CPU devices; Explicit and Auto meshes).
"""

import contextlib
import os


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from beartype import beartype  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard import Float, Int  # noqa: E402


# FSDP over `data` (weights' `embed` dim, and the batch) + TP over `model`.
RULES = {"embed": "data", "mlp": "model", "heads": "model", "vocab": "model"}
VOCAB, EMBED, HEADS, HEAD_DIM, MLP, LAYERS = 64, 32, 4, 8, 64, 2

Tokens = Int[Array, "batch seq", P("data", None)]
Acts = Float[Array, "batch seq embed", P("data", None, None)]
Hidden = Float[Array, "batch seq mlp", P("data", None, "model")]
# The weights as each matmul uses them: the FSDP dim gathered, the TP dim kept.
UsedIn = Float[Array, "embed mlp", P(None, "model")]
UsedOut = Float[Array, "mlp embed", P("model", None)]


def _init(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
    def __init__(self, rngs):
        shape = (EMBED, HEADS, HEAD_DIM)
        self.wq = nnx.Param(_init("embed", "heads", None)(rngs.params(), shape))
        self.wk = nnx.Param(_init("embed", "heads", None)(rngs.params(), shape))
        self.wv = nnx.Param(_init("embed", "heads", None)(rngs.params(), shape))
        self.wo = nnx.Param(
            _init("heads", None, "embed")(rngs.params(), (HEADS, HEAD_DIM, EMBED))
        )
        self.w_in = nnx.Linear(
            EMBED, MLP, use_bias=False, kernel_init=_init("embed", "mlp"), rngs=rngs
        )
        self.w_out = nnx.Linear(
            MLP, EMBED, use_bias=False, kernel_init=_init("mlp", "embed"), rngs=rngs
        )

    def __call__(self, x):
        x = x + attend(x, *(_gathered(w[...]) for w in (self.wq, self.wk, self.wv)),
                       jts.reshard(self.wo[...], P("model", None, None)))  # fmt: skip
        h = up(x, jts.reshard(self.w_in.kernel[...], UsedIn))
        return x + down(h, jts.reshard(self.w_out.kernel[...], UsedOut))


def _out(spec):
    """The result's layout where JAX takes one (Explicit axes); XLA's on Auto."""
    return spec if jax.sharding.get_abstract_mesh().are_all_axes_explicit else None


def _gathered(w):
    return jts.reshard(w, P(None, "model", None))


@jts.jaxtyped(typechecker=beartype)
def up(x: Acts, w_in: UsedIn) -> Hidden:
    return jax.nn.gelu(jnp.einsum("bse,em->bsm", x, w_in))


@jts.jaxtyped(typechecker=beartype)
def down(h: Hidden, w_out: UsedOut) -> Acts:
    return jnp.einsum("bsm,me->bse", h, w_out, out_sharding=_out(P("data", None, None)))


@jts.jaxtyped(typechecker=beartype)
def attend(x: Acts, wq, wk, wv, wo) -> Acts:
    q, k, v = (jnp.einsum("bse,ehk->bshk", x, w) for w in (wq, wk, wv))
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / HEAD_DIM**0.5
    o = jnp.einsum("bhst,bthk->bshk", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bshk,hke->bse", o, wo, out_sharding=_out(P("data", None, None)))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Param(_init("vocab", "embed")(rngs.params(), (VOCAB, EMBED)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.unembed = nnx.Param(_init("embed", "vocab")(rngs.params(), (EMBED, VOCAB)))

    def __call__(self, tokens):
        table = jts.reshard(self.embed[...], P())
        x = table.at[tokens].get(out_sharding=_out(P("data", None, None)))
        for block in self.blocks:
            x = block(x)
        return jnp.einsum("bse,ev->bsv", x, jts.reshard(self.unembed[...], P()))


@jts.jaxtyped(typechecker=beartype)
def loss_of(model: Model, tokens: Tokens) -> Float[Array, ""]:
    logits = model(tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    jts.check_tree(model, name="model")
    jts.check_tree(optimizer, name="optimizer")
    loss, grads = nnx.value_and_grad(loss_of)(model, tokens)
    # On Auto axes the cotangent of a sharding constraint keeps the constraint:
    # the gradient of an FSDP weight gathered for its matmul comes back gathered
    # (check_tree below names every one) unless laid out as its parameter again.
    grads = jax.tree.map(jts.reshard, grads, jts.shardings(grads))
    jts.check_tree(grads, name="grads")
    optimizer.update(model, grads)
    return loss


def make_mesh(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)


BASELINE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "nnx_collectives.json"
)


@contextlib.contextmanager
def setup(kind="explicit", rules=RULES):
    """The model, its optimiser and a batch, laid out under `rules` on a mesh of
    `kind`, with that mesh and those rules in force."""
    mesh = make_mesh(kind)
    with jts.axis_rules(rules), nnx.logical_axis_rules(jts.flax_rules()):
        with jax.set_mesh(mesh):
            model = jts.sharded_init(lambda: Model(nnx.Rngs(0)), mesh=mesh)
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            data = jax.random.randint(jax.random.key(1), (8, 17), 0, VOCAB)
            tokens = jts.place(data, Tokens, mesh)
            yield model, optimizer, tokens


def collectives(kind="explicit", rules=RULES):
    """The step's collectives, each at its call site (one compile, nothing run),
    held to `nnx_collectives.json` by the tests; `python
    examples/nnx_transformer.py --update-collectives` rewrites this JAX
    release's section of it."""
    with setup(kind, rules) as (model, optimizer, tokens):
        return jts.collectives(train_step, model, optimizer, tokens)


def train(kind="explicit", steps=3, rules=RULES):
    with setup(kind, rules) as (model, optimizer, tokens):
        return [float(train_step(model, optimizer, tokens)) for _ in range(steps)]


if __name__ == "__main__":
    import sys

    if "--update-collectives" in sys.argv:
        collectives().save(BASELINE)
    for kind in ("explicit", "auto"):
        collectives(kind).check(BASELINE)
        losses = train(kind)
        assert losses[-1] < losses[0], losses
        print(f"{kind}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
