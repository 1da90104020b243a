"""Planted mis-shardings in examples/nnx_transformer.py, each a one-line mutation.

Each case replaces one line of the example (checked: exactly one line differs),
imports the copy as a module of its own and trains it for one step. The mutation
must be caught, with the culprit's path or argument named; on a mesh kind where
the line is no mis-sharding, the copy trains with no false alarm. The unmutated
example trains on both kinds.
"""

from pathlib import Path
from typing import NamedTuple

import pytest


pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

import jaxtyping_shard as jts  # noqa: E402

from .helpers import one_line_mutant  # noqa: E402


EXAMPLE = Path(__file__).parent.parent / "examples" / "nnx_transformer.py"
KINDS = ("explicit", "auto")
CAUGHT = (jts.ShardingTypeCheckError, jts.ShardingAnnotationError)


class Bug(NamedTuple):
    old: str
    new: str
    culprit: str  # what the error must name
    kinds: tuple = KINDS  # where it is a mis-sharding


BUGS = {
    # The batch replicated on every device instead of split over `data`.
    "batch_replicated": Bug(
        "tokens = jts.place(data, Tokens, mesh)",
        "tokens = jax.device_put(data, jax.NamedSharding(mesh, P()))",
        "argument `tokens` of `loss_of`",
    ),
    # Flax given another table than jaxtyping_shard: Flax's eager sharding lays
    # the optimizer's moments out by it (the model comes from sharded_init).
    "flax_rules_drift": Bug(
        "with jts.axis_rules(rules), nnx.logical_axis_rules(jts.flax_rules()):",
        "with jts.axis_rules(rules), nnx.logical_axis_rules(jts.flax_rules({"
        "**rules, 'mlp': None})):",
        "optimizer.opt_state[0].mu['blocks'][0]['w_in']['kernel'].value",
    ),
    # The MLP's input weight gathered with the output weight's layout.
    "w_in_gathered_as_w_out": Bug(
        "h = up(x, jts.reshard(self.w_in.kernel[...], UsedIn))",
        "h = up(x, jts.reshard(self.w_in.kernel[...], P('model', None)))",
        "argument `w_in` of `up`",
    ),
    # The activations resharded over `data` by their embed dim before the MLP.
    "activations_resharded": Bug(
        "h = up(x, jts.reshard(self.w_in.kernel[...], UsedIn))",
        "h = up(jts.reshard(x, P(None, None, 'data')), jts.reshard("
        "self.w_in.kernel[...], UsedIn))",
        "argument `x` of `up`",
    ),
    # The row-parallel result left split over `model` (Explicit: the layout the
    # einsum is told; on Auto axes XLA decides, and the line changes nothing).
    "activation_left_on_model": Bug(
        'return jnp.einsum("bsm,me->bse", h, w_out, out_sharding=_out(P("data", '
        "None, None)))",
        'return jnp.einsum("bsm,me->bse", h, w_out, out_sharding=_out(P("data", '
        'None, "model")))',
        "the return value of `down`",
        kinds=("explicit",),
    ),
    # FSDP gradients left as the gathered weights' cotangents (Auto axes keep a
    # constraint's layout on its cotangent; Explicit reshards them back).
    "grads_left_gathered": Bug(
        "grads = jax.tree.map(jts.reshard, grads, jts.shardings(grads))",
        "grads = grads",
        "grads['blocks'][0]['w_in']['kernel'].value",
        kinds=("auto",),
    ),
}


def mutant(name: str, bug: Bug, root: Path):
    path = root / f"nnx_bug_{name}.py"
    return one_line_mutant(EXAMPLE, bug.old, bug.new, path, path.stem)


@pytest.mark.parametrize("kind", KINDS)
def test_unmutated_example_raises_nothing(tmp_path, kind):
    (loss,) = mutant(f"none_{kind}", Bug("", "", ""), tmp_path).train(kind, steps=1)
    assert loss > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_is_caught_by_path(tmp_path, name, kind):
    bug = BUGS[name]
    module = mutant(f"{name}_{kind}", bug, tmp_path)
    if kind not in bug.kinds:
        (loss,) = module.train(kind, steps=1)  # no false alarm
        assert loss > 0
        return
    with pytest.raises(CAUGHT) as caught:
        module.train(kind, steps=1)
    assert bug.culprit in str(caught.value), str(caught.value)[:2000]


def test_at_least_six_bugs():
    assert len(BUGS) >= 6
