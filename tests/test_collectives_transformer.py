"""The reference step's collectives: `examples/transformer`'s FSDP + TP training
step on the 4x2 mesh, held to `examples/transformer/collectives.json`.

- The unmutated program matches its baseline on Explicit and Auto meshes (and on
  2 processes: the example checks itself in `test_transformer.py`'s job), and
  every line of its report is explained in docs/collectives.md.
- Each planted one-line mis-sharding that no annotation sees (the program still
  compiles and trains) shows as a new collective naming the mutated line, in the
  style of `test_transformer_bugs.py`: one line of a copy of the example changed,
  found by a text that names what it mutates.
"""

import importlib
from pathlib import Path
from typing import NamedTuple

import pytest

import jaxtyping_shard as jts
from examples.transformer import collectives as reference
from jaxtyping_shard._core import compat

from .test_transformer_bugs import KINDS, mutate, root  # noqa: F401 (a fixture)


DOCS = Path(__file__).parent.parent / "docs" / "collectives.md"


class Planted(NamedTuple):
    file: str
    old: str
    new: str
    kinds: tuple  # the new collectives it must show, by kind
    over: str  # the mesh axes of the first of them
    # Where JAX itself refuses the program on Explicit meshes (JAX 0.12 checks
    # that an einsum's batch dims agree): caught before any report.
    refused_on_explicit: bool = False
    # Where on Auto meshes XLA carries the layout back into an annotated value,
    # so the annotations catch it before any report.
    caught_on_auto: bool = False
    # Where from JAX 0.12 the new collective is made at the op that produced the
    # value the mutated line lays out (its layout propagates back onto that op,
    # which then gathers its operands): that op's line, as written in the file.
    producer_from_0_12: str = ""


PLANTED = {
    # The attention weights gathered over the batch inside `attend` (an
    # unannotated intermediate).
    "attention_weights_gathered": Planted(
        "model.py",
        "weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)",
        "weights = jts.reshard(jax.nn.softmax(jnp.where(causal, scores, -1e9), "
        'axis=-1), jax.sharding.PartitionSpec(None, "model"))',
        ("all-gather",),
        "data",
        refused_on_explicit=True,
    ),
    # The gradients replicated as optax takes them, after their check (the
    # parameters and the moments still come out sharded).
    "optimizer_updates_replicated": Planted(
        "train.py",
        "updates, opt_state = optimizer.update(grads, opt_state, params)",
        "updates, opt_state = optimizer.update(jts.reshard(grads, "
        "jax.sharding.PartitionSpec()), opt_state, params)",
        ("all-gather",),
        "data",
        caught_on_auto=True,  # the gradients' check names them, replicated
        producer_from_0_12=(
            "loss, grads = jax.tree.map(lambda x: x / MICRO, (loss, grads))"
        ),
    ),
    # A concatenate over a sharded dim (the heads, split over `model`).
    "concatenate_over_sharded_dim": Planted(
        "model.py",
        'return jts.einsum("bshd,hde->bse", heads, wo)',
        'return jts.einsum("bshd,hde->bse", jnp.concatenate([heads[:, :, :2], '
        "heads[:, :, 2:]], axis=2), wo)",
        ("all-to-all", "collective-permute"),
        "model",
    ),
    # A replicated weight used once more: its gradient is a sum over the batch.
    "replicated_weight_gradient": Planted(
        "model.py",
        "x = layer_norm(x, self.ln_f)",
        "x = layer_norm(x, self.ln_f) * self.ln_f",
        ("all-reduce",),
        "data",
    ),
}


def weight_gathers(report) -> frozenset:
    """The functions the step's all-gathers over `data` are made in: those that
    gather the weights (where this JAX release places them)."""
    return frozenset(
        name
        for row in report.where(kind="all-gather", axes="data").rows
        for source in row.sources
        for name in (source.function, source.annotated)
        if name
    )


@pytest.mark.parametrize("kind", KINDS)
def test_reference_step_matches_its_baseline_and_is_explained(kind):
    report = reference.report(kind)
    report.check(reference.baseline(kind))
    assert report.count > 0 and not any(r.layout_only for r in report.rows)
    # Every line of the table is walked through in the docs.
    docs = DOCS.read_text()
    missing = {
        source.text
        for row in report.rows
        for source in row.sources
        if source.text not in docs
    }
    assert not missing, f"docs/collectives.md does not explain {sorted(missing)}"
    # And every call site (a helper's callers: `q = project(x, attn.wq)`, ...).
    sites = {site.text for row in report.rows for site in row.sites}
    if compat.hlo_stack_frames_usable():  # JAX 0.8: a site is the op's line
        assert sites - {s.text for r in report.rows for s in r.sources}
    unsaid = {
        text for text in sites if " ".join(text.split()) not in " ".join(docs.split())
    }
    assert not unsaid, (
        f"docs/collectives.md does not name the call sites {sorted(unsaid)}"
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_mis_sharding_is_a_new_collective_at_its_line(root, name, kind):  # noqa: F811
    planted = PLANTED[name]
    package = mutate(f"collectives_{name}_{kind}", planted, root)
    module = importlib.import_module(f"{package}.collectives")
    if planted.refused_on_explicit and kind == "explicit":
        try:
            report = module.report(kind)
        except Exception as error:  # JAX's ShardingTypeError, not public
            assert type(error).__name__ == "ShardingTypeError", error
            assert compat.JAX_VERSION >= (0, 11), error
            return
    elif planted.caught_on_auto and kind == "auto":
        with pytest.raises(jts.ShardingTypeCheckError, match="grads.embed"):
            module.report(kind)
        return
    else:
        report = module.report(kind)
    path = root / package / planted.file
    expected = planted.new
    if planted.producer_from_0_12 and compat.JAX_VERSION >= (0, 12):
        expected = planted.producer_from_0_12
    (line,) = [
        i
        for i, text in enumerate(path.read_text().splitlines(), 1)
        if text.strip() == expected
    ]
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(reference.baseline(kind))
    problems = [p for p in str(caught.value).splitlines() if p.startswith("  ")]
    at_line = [p for p in problems if f" at {planted.file}:{line}" in p]
    assert at_line, str(caught.value)
    assert all(p.split(". ", 1)[1].startswith("new: ") for p in at_line)
    assert {
        k for k in planted.kinds if any(f"new: {k} over" in p for p in at_line)
    } == (set(planted.kinds)), at_line
    assert f"new: {planted.kinds[0]} over {planted.over}," in "\n".join(at_line)
    assert expected in "\n".join(at_line)  # the line's text, as written
    if name == "attention_weights_gathered" and compat.hlo_stack_frames_usable():
        # The simple bound: no all-gather over `data` outside the functions
        # that gather the weights catches it too, naming `attend`.
        allowed = weight_gathers(reference.report(kind))
        with pytest.raises(jts.CollectiveBudgetError, match=r"in `attend`: weights"):
            report.check(
                forbid=[{"kind": "all-gather", "axes": "data", "outside": allowed}]
            )
        reference.report(kind).check(
            forbid=[{"kind": "all-gather", "axes": "data", "outside": allowed}]
        )


def test_the_report_of_a_trained_step_compiles_nothing():
    from examples.transformer import train

    from .helpers import Compiles

    train.train("fsdp_tp", "explicit", steps=1)
    with Compiles() as compiles:
        report = reference.report("explicit")  # for abstract arguments
    assert compiles.count == 0
    report.check(reference.BASELINE)
