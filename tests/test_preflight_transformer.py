"""The reference program preflighted on a 4,096-device mesh (512 x 8), and its
report measured against XLA's own memory analysis on the real 4 x 2 mesh.

The planted bugs are `test_transformer_bugs.py`'s: each mutant's inputs are made
by its own `init` and `load_batch` under `jax.eval_shape`
(`examples/transformer/preflight.py`), so a bug in how the inputs are built is
seen as a real run sees it."""

import importlib
import io
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxtyping_shard as jts
from examples.transformer import layout, model, preflight as example, train
from jaxtyping_shard._core import compat

from .test_transformer_bugs import BUGS, mutate


CAUGHT = (jts.ShardingTypeCheckError, jts.ShardingAnnotationError)
# Small, and divisible by the pod's 512 `data` devices where FSDP shards.
SMALL = dict(vocab=64, embed=512, heads=8, head_dim=8, mlp=64, layers=1)
SMALL_POD = dict(SMALL, batch=1024, seq=512)  # 2 micro-batches of 1 row each


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("preflight_mutants")
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))


def _places(culprit: str) -> tuple[str, str]:
    """`(needle, anchor)`: how preflight names the culprit a real run names (the
    same place, in its own words and at its own sizes), and what its first
    finding must name: the same value, or for a leaf of the result, the result."""
    leaf = re.fullmatch(r"return(\[\d+\]\S*)", culprit)
    if leaf:
        return f"leaf `{leaf.group(1)}` of the return value", "of the return value"
    sized = re.fullmatch(r"(`[^`]+`) is `\w+\[[\d,]+\]`", culprit)
    if sized:  # the real run's message carries its smaller shape
        return f"{sized.group(1)} of `train_step` is", f"{sized.group(1)} of"
    return culprit, culprit


@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_is_caught_at_4096_devices(root, name):
    bug = BUGS[name]
    package = mutate(f"preflight_{name}", bug, root)
    mutant = importlib.import_module(f"{package}.preflight")
    config = importlib.import_module(f"{package}.model").Config(**SMALL_POD)
    mesh = mutant.make_mesh((512, 8), "explicit")
    if "explicit" not in bug.kinds:
        # Not a mis-sharding on Explicit axes: no false alarm either.
        assert mutant.preflight(config, mesh).checks.complete
        return
    try:
        mutant.preflight(config, mesh)
    except CAUGHT as error:
        text = str(error)
    else:
        # Only on JAX 0.8 may a bug go unseen, and only this kind: a value the
        # pipeline makes without a layout (the optimiser state by `jnp.zeros`)
        # has no mesh in its traced type there, so `jax.eval_shape` gives it no
        # sharding and preflight places it as annotated (docs/compat.md).
        assert not compat.fresh_values_have_a_mesh(), f"{name} not caught"
        inputs = mutant.abstract_inputs(config, mesh)
        assert any(leaf.sharding is None for leaf in jax.tree.leaves(inputs))
        return
    needle, anchor = _places(bug.culprit)
    assert needle in text, text
    first = text.split("\n  2. ")[0]  # the first finding (or the whole error)
    assert anchor in first, text


def test_the_reference_step_passes_at_4096_devices():
    report = example.preflight(model.Config(**SMALL_POD), example.make_mesh())
    assert report.checks.complete and report.checks.compiled_on is None
    # Every leaf laid out: the optimiser state by `jts.Like["params"]` (its
    # count replicated), none left to XLA.
    assert report.checks.unannotated == ()
    groups = report.by_argument()
    assert set(groups) == {"params", "opt_state", "batch", "outputs"}
    assert groups["opt_state"] == 2 * groups["params"] + 4  # two moments, a count
    assert groups["outputs"] == groups["params"] + groups["opt_state"] + 4  # + loss
    # The batch: 1024 x 512 tokens and labels over 512 `data` devices.
    assert groups["batch"] == 2 * 2 * 512 * 4
    # At 4,096 devices, after each device's 2 rows of the batch, the layer
    # norms' scales, whole on every device, outweigh its shard of any weight.
    largest = report.largest(6)
    assert [leaf.path for leaf in largest[:3]] == [
        "batch.tokens",
        "batch.labels",
        "params.blocks.ln1",
    ]
    assert all(leaf.replicated for leaf in largest[2:])


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_report_bytes_are_xla_bytes_on_the_real_mesh(kind):
    """Arguments to the byte; results too, once XLA's result tuple is counted: on
    CPU it holds one 8-byte buffer pointer per result leaf."""
    mesh = train.make_mesh((4, 2), kind)
    config = model.Config(layers=1)
    key = jax.random.key(0, impl="rbg")
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
    with jax.set_mesh(mesh), jts.axis_rules(layout.RULES["fsdp_tp"]):
        # As `init` makes them (`jts.abstract` is `sharded_init`'s plan), unrun.
        params, opt = jts.abstract(train.init_state, key, config, mesh=mesh)
        batch = train.Batch(tokens, tokens)  # placed as annotated
        report = jts.preflight(train.train_step, params, opt, batch, mesh=mesh)
        # On Auto axes preflight compiles the step on this (concrete) mesh, and
        # keeps XLA's analysis; on Explicit axes it has no need to compile.
        if kind == "auto":
            memory = report.xla_memory
        else:
            assert report.xla_memory is None
            memory = train.train_step.lower(params, opt, batch).compile()
            memory = memory.memory_analysis()
    results = [leaf for leaf in report.leaves if leaf.group == "outputs"]
    assert not report.unknown
    assert memory.argument_size_in_bytes == report.argument_bytes
    assert memory.output_size_in_bytes == report.output_bytes + 8 * len(results)


def _readme_block() -> tuple[str, str]:
    text = (Path(example.__file__).parent / "README.md").read_text()
    match = re.search(
        r"```text\n\$ (python -m examples\.transformer\.preflight[^\n]*)\n(.*?)```",
        text,
        re.S,
    )
    assert match, "examples/transformer/README.md shows no preflight output"
    return match.group(1), match.group(2)


def test_the_readme_shows_what_the_command_prints():
    command, shown = _readme_block()
    argv = command.split()[3:]
    out = io.StringIO()
    with redirect_stdout(out):
        assert example.main(argv) == 0
    assert out.getvalue() == shown, (
        "examples/transformer/README.md is stale: regenerate its block with "
        f"`{command}`"
    )
