"""The roll-up on programs written the field's way: the reference step
(`examples/transformer`: Equinox modules, stacked blocks scanned over), the
NNX example (an `nnx.List` of blocks walked by a `for` loop), on Explicit and
Auto meshes, and the Linen model (`Decoder(c, name=f"layers_{i}")`, Auto). The
roll-up adds up to the flat totals, the stacked layers roll up as one node
(`blocks[*]`, `layers_*`) with the modules inside it, and the value_and_grad
step has a forward and a backward pass. On JAX 0.8 (one frame per op, no
functions) every part is at the root: the documented limit, asserted.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from jaxtyping_shard._core import compat

from .test_collectives_rollup import adds_up


FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: stacks are known
EXAMPLES = Path(__file__).parent.parent / "examples"


def _example(name):
    spec = importlib.util.spec_from_file_location(
        f"rollup_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def node_named(root, name):
    found = [n for n in root.walk() if n.name == name]
    assert len(found) == 1, (name, str(root))
    return found[0]


def paths(report):
    return {".".join(p.path) for r in report.rows for p in r.parts}


def both_passes(report):
    passes = report.by_phase()
    assert passes["forward"].count > 0 and passes["backward"].count > 0
    assert passes["forward"].bytes > 0 and passes["backward"].bytes > 0
    assert all("transpose(" in p.op_name for r in report.rows for p in r.parts
               if p.phase == "backward")  # fmt: skip


def at_root_on_jax_0_8(report):
    """The limit: JAX 0.8 keeps no functions, so no path is known."""
    assert paths(report) == {""}
    assert report.rollup().children == ()


@pytest.fixture(scope="module", params=["explicit", "auto"])
def reference(request):
    from examples.transformer import collectives as reference

    return request.param, reference.report(request.param)


def test_the_reference_step_rolls_up_by_module(reference):
    kind, report = reference
    root = adds_up(report)
    both_passes(report)
    assert root.name == "train_step"
    if not FRAMES:
        at_root_on_jax_0_8(report)
        return
    blocks = node_named(root, "blocks[*]")
    assert blocks.path.endswith("Transformer.blocks[*]")
    assert {c.name for c in blocks.children} >= {"attn", "mlp", "layer_norm"}
    attn = blocks.find("attn")
    assert attn is not None and {c.name for c in attn.children} == {"project", "mix"}
    assert root.find(blocks.path + ".attn.project") is attn.find("project")
    assert blocks.forward.count > 0 and blocks.backward.count > 0
    # The stacked blocks are scanned over: every part under them is in a loop.
    for row in report.rows:
        for part in row.parts:
            if "blocks[*]" in part.path:
                assert row.in_loop, row
    # Outside the scan: the embedding and the loss.
    transformer = node_named(root, "Transformer")
    assert {"lookup", "blocks[*]"} <= {c.name for c in transformer.children}
    assert node_named(root, "cross_entropy").backward.count == 0 or kind == "auto"
    if kind == "explicit":
        # The weights gathered once before the micro-batch scan and their
        # deferred reduction after it: outside the differentiated function.
        deferred = [p for r in report.rows for p in r.parts if p.deferred]
        assert deferred and all(p.phase == "other" for p in deferred)
        assert report.by_phase()["other"].count > 0


def test_the_reference_step_in_json_and_at_each_detail(reference):
    kind, report = reference
    data = json.loads(report.to_json())
    assert data["rollup"]["count"] == report.count == data["count"]
    assert sum(t["bytes"] for t in data["by_phase"].values()) == report.bytes
    modules = report.table(detail="modules")
    frames = report.table(detail="frames")
    assert str(report.rollup()) in modules
    if FRAMES:
        assert "blocks[*]" in modules and "model.py" in frames
        assert "(Block.__call__)" in frames
    assert frames.count(" -> ") == sum(len(r.parts) for r in report.rows)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_the_nnx_example_rolls_up_its_list_of_blocks(kind):
    pytest.importorskip("flax.nnx")
    report = _example("nnx_transformer").collectives(kind)
    root = adds_up(report)
    both_passes(report)
    if not FRAMES:
        at_root_on_jax_0_8(report)
        return
    # `for block in self.blocks: x = block(x)`: the blocks as one node.
    blocks = node_named(root, "blocks[*]")
    assert blocks.path == "loss_of.Model.blocks[*]"
    assert {c.name for c in blocks.children} >= {"attend", "up", "down"}
    assert blocks.count > 0 and blocks.backward.bytes > 0


def test_the_linen_model_rolls_up_its_named_layers():
    # On an Auto mesh, as MaxText runs it: on Explicit axes Linen's
    # `nn.with_logical_constraint` is an assertion JAX refuses (linen_lm.py).
    pytest.importorskip("flax.linen")
    report = _example("linen_lm").collectives("auto")
    root = adds_up(report)
    both_passes(report)
    if not FRAMES:
        at_root_on_jax_0_8(report)
        return
    # `Decoder(c, name=f"layers_{i}")(x)` in a Python loop: Linen's names.
    layers = node_named(root, "layers_*")
    assert layers.path.endswith("Transformer.layers_*")
    assert {c.name for c in layers.children} >= {"Attention", "Mlp"}
    assert node_named(root, "token_embedder").count > 0


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_weight_mislaid_in_the_blocks_grows_only_the_blocks(tmp_path, kind):
    pytest.importorskip("flax.nnx")
    from .test_nnx_collectives import copy, WO, WO_WHOLE

    same = copy(tmp_path, f"same_{kind}")[0].collectives(kind).rollup()
    mislaid = copy(tmp_path, f"wo_{kind}", WO, WO_WHOLE)[0].collectives(kind)
    root = adds_up(mislaid)
    assert root.bytes > same.bytes
    if not FRAMES:
        return
    blocks, before = node_named(root, "blocks[*]"), node_named(same, "blocks[*]")
    assert blocks.bytes - before.bytes == root.bytes - same.bytes > 0
    # Every node outside the blocks (and not above them) is as it was.
    for node in same.walk():
        if node.path.startswith(blocks.path) or blocks.path.startswith(node.path):
            continue
        now = root.find(node.path)
        assert now is not None and (now.count, now.bytes) == (node.count, node.bytes)
