"""`jts.layouts` on the reference program: `examples/transformer`'s FSDP + TP
training step on the 4x2 mesh, Explicit (the trace's types) and Auto (as XLA
propagated, the compiled program unchanged by the reading), held to a
baseline, and one planted mis-layout of an intermediate (the loss's one-hot
targets replicated) caught at its line on both meshes.
"""

import importlib
import re

import jax
import pytest

import jaxtyping_shard as jts
from examples.transformer import layout as LAYOUT
from jaxtyping_shard._report import propagated

from .test_transformer_bugs import Bug, mutate, root  # noqa: F401 (a fixture)


def report(kind, package="examples.transformer"):
    train = importlib.import_module(f"{package}.train")
    layout = importlib.import_module(f"{package}.layout")
    config = importlib.import_module(f"{package}.model").Config(layers=1)
    mesh = train.make_mesh((4, 2), kind)
    with jax.set_mesh(mesh), jts.axis_rules(layout.RULES["fsdp_tp"]):
        own = importlib.import_module(f"{package}.collectives")
        args = own.arguments(config, mesh)
        return jts.layouts(train.train_step, *args), train, args


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_reference_step_layouts_by_line_and_held(tmp_path, kind):
    found, train, args = report(kind)
    assert found.source == ("types" if kind == "explicit" else "xla")
    assert len(found.rows) > 50 and not found.unread
    files = {r.site.file for r in found.rows if r.site is not None}
    assert "model.py" in files
    sharded = [r for r in found.rows if "@" in r.layout and r.site is not None]
    assert sharded, str(found)
    path = tmp_path / "layouts.json"
    found.save(path)
    report(kind)[0].check(path)  # a second report: the same


def test_auto_reading_adds_no_op():
    _, train, args = report("auto")
    mesh = train.make_mesh((4, 2), "auto")
    with jax.set_mesh(mesh), jts.axis_rules(LAYOUT.RULES["fsdp_tp"]):
        lowered = train.train_step.lower(*args)
    dumped, text, _ = propagated.compile_dumped(lowered)
    assert text is not None
    assert dumped.as_text() == lowered.compile().as_text()


# The one-hot targets of the loss replicated: an intermediate no annotation
# covers (the loss's result is a scalar either way); the step still trains.
MUTATION = (
    "model.py",
    "targets = jts.reshard(jax.nn.one_hot(labels, logits.shape[-1]), Logits)",
    "targets = jts.reshard(jax.nn.one_hot(labels, logits.shape[-1]), "
    "jax.sharding.PartitionSpec())",
)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_an_intermediate_laid_out_anew_in_the_reference_is_caught(
    tmp_path,
    root,  # noqa: F811
    kind,
):
    path = tmp_path / "layouts.json"
    report(kind)[0].save(path)
    package = mutate(f"layouts_targets_{kind}", Bug(*MUTATION, culprit=""), root)
    with pytest.raises(jts.LayoutChangeError) as caught:
        report(kind, package)[0].check(path)
    message = str(caught.value)
    first = message.splitlines()[1]
    assert "laid out anew: " in message
    assert re.search(
        r"model.py:\d+( in `cross_entropy`)?: targets = jts.reshard\(.*"
        r"PartitionSpec\(\)\) \(was `model.py: targets = jts.reshard\(.*Logits\)`\): "
        r"float32\[8@data,16,64@model\] -> float32\[8,16,64\]",
        message,
    ), message
    assert "model.py" in first, message
