"""Planted bugs in examples/linen_lm.py (a Linen LM in MaxText's style), each a
one-line mutation of a copy of the example, caught with the culprit named.

The example writes no annotation for its parameters or optimiser state: the
Linen boxes are the annotations. A bug in the state (the rules, a box, a
parameter or a moment laid out otherwise) is caught by key path on Auto meshes
by `jts.jit` at the step's boundary, and on Explicit meshes by `check_tree` of
the initial state (the step itself runs on Auto axes only: Linen's
`nn.with_logical_constraint` is `with_sharding_constraint`, an assertion on
Explicit axes, that the step's one-hot lookup does not meet). A bug no
annotation sees (an activation constraint changed, a box renamed consistently)
grows the step's collectives over `examples/linen_lm_collectives.json`, at the
mutated line.
"""

from pathlib import Path
from typing import NamedTuple

import pytest


pytest.importorskip("flax.linen")
pytest.importorskip("optax")

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard._core import compat  # noqa: E402

from .helpers import one_line_mutant  # noqa: E402


EXAMPLE = Path(__file__).parent.parent / "examples" / "linen_lm.py"
BASELINE = EXAMPLE.with_name("linen_lm_collectives.json")
KINDS = ("auto", "explicit")
CAUGHT = (jts.ShardingTypeCheckError, jts.ShardingAnnotationError)
LOGITS = "['params']['logits']['kernel'].value"


class Bug(NamedTuple):
    old: str
    new: str
    culprit: str  # what the error must name (COLLECTIVE_BUGS: the line's text)


STATE_BUGS = {
    # The config's table maps `mlp` to `data`, which `embed` already takes:
    # Linen would replicate the dim in silence.
    "mlp_rule_on_data": Bug(
        '("mlp", "model"),',
        '("mlp", "data"),',
        "['params']['layers_0']['Mlp_0']['wi']['kernel'].value",
    ),
    # A parameter replicated, as a restore with no target would give it.
    "param_replicated_after_restore": Bug(
        "params = jts.sharded_init(model.init, key, tokens, mesh=mesh)",
        "params = jts.sharded_init(model.init, key, tokens, mesh=mesh); "
        "k = params['params']['logits']['kernel']; params['params']['logits']"
        "['kernel'] = k.replace_boxed(jax.device_put(k.value, "
        "jax.NamedSharding(mesh, P())))",
        LOGITS,
    ),
    # adamw's first moment laid out by the batch's axis only.
    "moment_laid_out_wrongly": Bug(
        "return params, tx.init(params)",
        "o = tx.init(params); return params, (o[0]._replace(mu=jax.device_put("
        "o[0].mu, jax.NamedSharding(mesh, P()))), *o[1:])",
        "[0].mu['params']",
    ),
    # A box with one name fewer than its parameter's dims.
    "box_missing_a_name": Bug(
        'boxed(normal, "embed", "heads", "kv"),',
        'boxed(normal, "embed", "heads"),',
        "['params']['layers_0']['Attention_0']['key']`: flax.linen.spmd."
        "LogicallyPartitioned carries layout metadata this library cannot read: "
        "2 names ('embed', 'heads') for an array of rank 3",
    ),
}

WI = 'h = nn.gelu(nn.Dense(c.mlp, use_bias=False, kernel_init=kernel, name="wi")(x))'
# Each a mis-sharding no annotation sees: the step still trains; its
# collectives grow, at the mutated line.
COLLECTIVE_BUGS = {
    # The MLP's hidden activations pinned replicated instead of over `model`.
    "mlp_constraint_changed": Bug(
        'h = nn.with_logical_constraint(h, (*BSE[:2], "activation_mlp"))',
        "h = nn.with_logical_constraint(h, (*BSE[:2], None))",
        # The constraint's layout propagates onto the op that makes `h`.
        WI,
    ),
    # The up-projection boxed with its names swapped (consistently: the
    # parameter is created and checked by that box).
    "mlp_box_swapped": Bug(
        'kernel = boxed(normal, "embed", "mlp")',
        'kernel = boxed(normal, "mlp", "embed")',
        WI,  # the matmul that uses the kernel
    ),
}


def mutant(name: str, bug: Bug, root: Path):
    folder = root / name
    folder.mkdir()
    path = folder / "linen_lm.py"  # the baseline's file name
    return one_line_mutant(EXAMPLE, bug.old, bug.new, path, f"linen_lm_{name}")


def line_of(text: str) -> int:
    lines = EXAMPLE.read_text().splitlines()
    (found,) = [i for i, line in enumerate(lines, 1) if text in line]
    return found


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return mutant("none", Bug("", "", ""), tmp_path_factory.mktemp("linen_lm"))


def test_unmutated_example_trains_and_matches_its_baseline(example):
    losses = example.train("auto", steps=3)
    assert losses[-1] < losses[0], losses
    example.collectives("auto").check(BASELINE)


@pytest.mark.parametrize("kind", KINDS)
def test_unmutated_state_checked_on_every_leaf_but_the_count(example, kind):
    summary = example.check_state(kind)
    assert summary.checked == 57, str(summary)
    # The silence is named: adamw's step count has no box.
    assert "state[1][0].count" in str(summary), str(summary)


def test_preflight_counts_the_boxed_state(example):
    report = example.preflight("auto")
    text = str(report)
    assert "params['params']['logits']['kernel'].value" in text
    assert "float32[32@data,64@model]" in text
    assert "opt_state[0].count" in text  # named as not checked, never a pass


def test_warm_step_given_a_replicated_param_is_caught(example):
    mesh = example.make_mesh("auto")
    with jax.set_mesh(mesh), example.rules():
        params, opt_state = example.init_state(jax.random.key(0), mesh)
        batch = example.load_batch(0, mesh)
        params, opt_state, _ = example.train_step(params, opt_state, batch)  # warm
        wrong = jax.device_put(params, NamedSharding(mesh, P()))
        with pytest.raises(jts.ShardingTypeCheckError) as caught:
            example.train_step(wrong, opt_state, batch)
    assert "params['params']" in str(caught.value)
    assert "train_step" in str(caught.value)


def test_replicated_batch_is_caught_as_the_steps_argument(tmp_path):
    bug = Bug(
        "return jts.place(data, Tokens, mesh)",
        "return jax.device_put(data, jax.NamedSharding(mesh, P()))",
        "tokens",
    )
    module = mutant("batch_replicated", bug, tmp_path)
    with pytest.raises(jts.ShardingTypeCheckError) as caught:
        module.train("auto", steps=1)
    text = str(caught.value)
    assert "argument `tokens`" in text and "train_step" in text, text[:2000]


def test_step_on_explicit_axes_is_refused_by_jax_as_documented(example):
    # Linen's activation constraints assert on Explicit axes: the one-hot's
    # layout (from the tokens) is not the constraint's. JAX's own error.
    with pytest.raises(AssertionError, match="acts as an assert when all axes"):
        example.train("explicit", steps=1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(STATE_BUGS))
def test_planted_state_bug_is_caught_by_path(tmp_path, name, kind):
    bug = STATE_BUGS[name]
    module = mutant(name, bug, tmp_path)
    with pytest.raises(CAUGHT) as caught:
        if kind == "auto":
            module.train(kind, steps=1)
        else:
            module.check_state(kind)
    assert bug.culprit in str(caught.value), str(caught.value)[:2000]


@pytest.mark.parametrize("name", list(COLLECTIVE_BUGS))
def test_planted_bug_grows_the_collectives_at_its_line(tmp_path, name):
    bug = COLLECTIVE_BUGS[name]
    module = mutant(name, bug, tmp_path)
    (loss,) = module.train("auto", steps=1)  # no annotation sees it
    assert loss > 0
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        module.collectives("auto").check(BASELINE)
    text = str(caught.value)
    assert "new: all-gather over model" in text, text
    if compat.hlo_stack_frames_usable():
        where = f"linen_lm.py:{line_of(bug.culprit)} in `Mlp.__call__`"
        assert where in text, text
    else:
        # JAX 0.8 keeps one frame per op, the innermost outside JAX: for an op
        # made inside Flax (nn.Dense's dot_general) that is Flax's line, not
        # the program's (docs/compat.md). The growth is still caught above.
        assert "linen_lm.py:" in text or "linear.py:" in text, text


def test_at_least_six_planted_bugs():
    assert len(STATE_BUGS) + len(COLLECTIVE_BUGS) + 1 >= 6
