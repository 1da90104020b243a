"""Planted mis-shardings in the transformer example, each a one-line mutation.

Each case replaces one line of the example's source (checked: exactly one line
differs), imports the mutated copy as a package of its own, and trains it for
one step on the 4x2 mesh under the FSDP + TP rules table. The mutation must be
caught by jaxtyping_shard, and the error's first named place must be the
culprit (the leaf path or the function argument where the wrong layout is
made), not a value downstream. The unmutated program raises nothing on the same
meshes (also in `test_transformer.py`, trained to the end).
"""

import importlib
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import jaxtyping_shard as jts


EXAMPLE = Path(__file__).parent.parent / "examples" / "transformer"
KINDS = ("explicit", "auto")


class Bug(NamedTuple):
    file: str
    old: str
    new: str
    culprit: str  # what the error must name first
    kinds: tuple = KINDS  # the mesh kinds on which it is a mis-sharding
    named: tuple = KINDS  # those of `kinds` on which the culprit is named first


PS = "jax.sharding.PartitionSpec()"
BUGS = {
    # A weight stored on the wrong axis: the MLP's output weight annotated with
    # the input weight's logical names (its `embed` dim split over `model`).
    "weight_on_wrong_axis": Bug(
        "model.py",
        "    w_out: MlpOut",
        '    w_out: Float[Array, "mlp embed", L("embed", "mlp")]',
        "argument `w_out` of `down`",
    ),
    # The FSDP all-gather forgotten: the MLP's stored weights reach its matmuls.
    # On Auto axes nothing then constrains the weight where it is used: XLA
    # carries its FSDP layout into the activations instead (their batch whole,
    # `embed` split), and the checks report the activations it reaches (a layer
    # norm's input, the scales' gradients) without the missing line. On
    # Explicit axes the step gathers every weight once, before the micro-batch
    # scan (`train.accumulate_unreduced`, issue 35): the MLP's weights reach it
    # gathered, so the line is no mis-sharding there (no false alarm either).
    "fsdp_gather_forgotten": Bug(
        "model.py",
        "mlp = jts.as_used(self)",
        "mlp = self",
        "argument `w_in` of `up`",
        kinds=("auto",),
        named=(),
    ),
    # The batch replicated on every device instead of split over `data`.
    "batch_replicated": Bug(
        "train.py",
        'return jts.place_for(train_step, "batch", local, mesh)',
        f"return jts.place(local, {PS}, mesh)",
        "`batch.tokens` is `int32[16,16]`",
    ),
    # After the MLP's row-parallel matmul the activation is left split over
    # `model` (a reduce-scatter where an all-reduce was meant).
    "activation_left_on_model": Bug(
        "model.py",
        'return jts.einsum("bsm,me->bse", h, w_out)',
        'return jts.reshard(jts.einsum("bsm,me->bse", h, w_out), MlpHidden)',
        "the return value of `down`",
    ),
    # The same after the attention's row-parallel matmul.
    "attention_output_left_on_model": Bug(
        "model.py",
        'return jts.einsum("bshd,hde->bse", heads, wo)',
        'return jts.reshard(jts.einsum("bshd,hde->bse", heads, wo), MlpHidden)',
        "the return value of `mix`",
    ),
    # Logits replicated (gathered over the vocabulary) before the loss.
    "replicated_logits": Bug(
        "train.py",
        "return cross_entropy(params(batch.tokens), batch.labels)",
        f"return cross_entropy(jts.reshard(params(batch.tokens), {PS}), batch.labels)",
        "argument `logits` of `cross_entropy`",
    ),
    # A layernorm scale stored sharded (FSDP over `embed`) where it should be
    # replicated. On Auto axes XLA gathers it before the scan over the layers
    # (a small all-gather), so where it is used it is laid out as annotated.
    "sharded_layernorm_scale": Bug(
        "model.py",
        "ln1: Scale",
        'ln1: Float[Array, "embed", L]',
        "argument `scale` of `layer_norm`",
        kinds=("explicit",),
    ),
    # Tensor parallelism forgotten inside a function: the query weight gathered
    # whole, so every device computes every head.
    "tp_forgotten": Bug(
        "model.py",
        "q = project(x, attn.wq)",
        'q = project(x, jts.reshard(attn.wq, Float[Array, "e h d", L(None, None, None)]))',  # noqa: E501
        "argument `w` of `project`",
    ),
    # An update that replicates the weights.
    "update_replicates_weights": Bug(
        "train.py",
        "return optax.apply_updates(params, updates), opt_state, loss",
        f"return jts.reshard(optax.apply_updates(params, updates), {PS}), "
        "opt_state, loss",
        "return[0].embed",
    ),
    # optax's state created from replicated zeros: every moment whole on every
    # device (the parameters themselves are right).
    "unsharded_optimizer_state": Bug(
        "train.py",
        "opt_state = jts.sharded_init(optimizer.init, params, mesh=mesh)",
        "opt_state = optimizer.init(jax.tree.map(lambda p: jnp.zeros(p.shape), "
        "params))",
        "opt_state[1][0].mu.embed",
    ),
    # The optimiser state replicated at the end of the step: every moment whole
    # on every device from the next step on (`jts.Like["params"]` at the return).
    "optimizer_state_replicated_in_step": Bug(
        "train.py",
        "return optax.apply_updates(params, updates), opt_state, loss",
        "return optax.apply_updates(params, updates), "
        f"jts.reshard(opt_state, {PS}), loss",
        "return[1][1][0].mu.embed",
    ),
    # The accumulated gradients replicated before the update.
    "gradients_replicated": Bug(
        "train.py",
        "loss, grads = jax.tree.map(lambda x: x / MICRO, (loss, grads))",
        f"loss, grads = jax.tree.map(lambda x: jts.reshard(x / MICRO, {PS}), "
        "(loss, grads))",
        "grads.embed",
    ),
    # Labels split over the sequence instead of the batch.
    "labels_over_sequence": Bug(
        "train.py",
        "labels: Tokens",
        'labels: jts.Int[jax.Array, "batch seq", jts.Logical("seq", "batch")]',
        "argument `labels` of `cross_entropy`",
    ),
    # The rules table puts `mlp` on `data`, which `embed` already uses.
    "rule_on_a_taken_axis": Bug(
        "layout.py",
        '"mlp": "model",',
        '"mlp": "data",',
        "output.blocks.mlp.w_in",
    ),
}


# A layout set with plain `jax.lax.with_sharding_constraint` (not `jts.reshard`)
# on an Auto mesh (on an Explicit one JAX itself refuses a constraint that
# changes a layout). XLA lays the values upstream out as constrained too, so a
# compile-time report listed a victim (the return value of `project`) before the
# culprit; the constraint's own value is decided at trace time, and named first.
CONSTRAINED = Bug(
    "model.py",
    "q = project(x, attn.wq)",
    "q = jax.lax.with_sharding_constraint(project(x, attn.wq), "
    "jax.sharding.PartitionSpec())",
    "argument `q` of `attend`",
    kinds=("auto",),
)


def mutate(name: str, bug: Bug, root: Path) -> str:
    """A copy of the example as package `bug_<name>` under `root`, one line changed."""
    package = f"bug_{name}"
    target = root / package
    shutil.copytree(EXAMPLE, target, ignore=shutil.ignore_patterns("__pycache__"))
    if bug.file:
        path = target / bug.file
        before = path.read_text()
        assert before.count(bug.old) == 1, (bug.file, bug.old)
        after = before.replace(bug.old, bug.new)
        changed = [
            (a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b
        ]
        assert len(changed) == 1 and len(before.splitlines()) == len(after.splitlines())
        path.write_text(after)
    return package


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("mutants")
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))


def train_one_step(package: str, kind: str) -> list[float]:
    train = importlib.import_module(f"{package}.train")
    config = importlib.import_module(f"{package}.model").Config(layers=1)
    return train.train("fsdp_tp", kind, steps=1, config=config)


CAUGHT = (jts.ShardingTypeCheckError, jts.ShardingAnnotationError)


@pytest.mark.parametrize("kind", KINDS)
def test_unmutated_program_raises_nothing(root, kind):
    package = mutate(f"none_{kind}", Bug("", "", "", ""), root)
    (loss,) = train_one_step(package, kind)
    assert loss > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_is_caught_at_the_culprit(root, name, kind):
    bug = BUGS[name]
    package = mutate(f"{name}_{kind}", bug, root)
    if kind not in bug.kinds:
        # Not a mis-sharding on this kind of mesh: no false alarm either.
        (loss,) = train_one_step(package, kind)
        assert loss > 0
        return
    with pytest.raises(CAUGHT) as caught:
        train_one_step(package, kind)
    text = str(caught.value)
    if kind not in bug.named:
        assert "sharding mismatch" in text, text
        return
    assert bug.culprit in text, text
    second = text.find("\n  2. ")  # several mismatches of one compile: culprit first
    assert second == -1 or text.index(bug.culprit) < second, text


def test_at_least_ten_bugs_per_mesh_kind():
    for kind in KINDS:
        assert sum(kind in bug.kinds for bug in BUGS.values()) >= 10


def test_planted_constraint_is_named_first(root):
    package = mutate("plain_constraint_auto", CONSTRAINED, root)
    with pytest.raises(CAUGHT) as caught:
        train_one_step(package, "auto")
    assert str(caught.value).startswith(CONSTRAINED.culprit), str(caught.value)
