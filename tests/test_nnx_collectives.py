"""The NNX example's step held to its baseline of collectives, keyed by call
site (`examples/nnx_collectives.json`), on both kinds of mesh; a weight
mis-laid at one line is blamed on that line alone."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest


pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard._core import compat  # noqa: E402


EXAMPLE = Path(__file__).parent.parent / "examples" / "nnx_transformer.py"
KINDS = ("explicit", "auto")


def copy(root: Path, name: str, old: str = "", new: str = ""):
    """The example as a module of its own, under its own file name (a baseline
    names files without their directory), with `old` replaced by `new`."""
    before = EXAMPLE.read_text()
    after = before
    if old:
        assert before.count(old) == 1, old
        after = before.replace(old, new)
    folder = root / name
    folder.mkdir()
    path = folder / "nnx_transformer.py"
    path.write_text(after)
    spec = importlib.util.spec_from_file_location(f"nnx_collectives_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module, after


@pytest.mark.parametrize("kind", KINDS)
def test_the_nnx_step_matches_its_baseline_by_call_site(tmp_path, kind):
    module, text = copy(tmp_path, f"same_{kind}")
    report = module.collectives(kind)
    report.check(EXAMPLE.with_name("nnx_collectives.json"))
    assert report.count > 0
    sites = [s for r in report.rows for s in r.sites]
    assert sites and all(s.text and s.text in text for s in sites)


WO = 'jts.reshard(self.wo[...], P("model", None, None)))  # fmt: skip'
WO_WHOLE = "jts.reshard(self.wo[...], P(None, None, None)))  # fmt: skip"


@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_mislaid_at_one_line_is_blamed_there(tmp_path, kind):
    module, text = copy(tmp_path, f"wo_{kind}", WO, WO_WHOLE)
    (line,) = [i for i, t in enumerate(text.splitlines(), 1) if t.strip() == WO_WHOLE]
    report = module.collectives(kind)
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(EXAMPLE.with_name("nnx_collectives.json"))
    problems = [p for p in str(caught.value).splitlines() if p.startswith("  ")]
    assert problems
    new = [p for p in problems if ". new: " in p]

    # At the mutated line, or where the weight is used (`attend`: XLA may move
    # the gather to the use, and JAX 0.12's partitioner records it there);
    # never at another site of the step.
    def named(problem):
        return {int(n) for n in re.findall(r"nnx_transformer\.py:(\d+)[ :]", problem)}

    assert new, problems
    if compat.JAX_VERSION < (0, 12):
        assert any(line in named(p) for p in new), problems
    lines = text.splitlines()
    start = lines.index("def attend(x: Acts, wq, wk, wv, wo) -> Acts:") + 1
    attend = range(start, start + 6)  # its lines (JAX 0.8 names no function)
    for problem in problems:
        assert named(problem) and named(problem) <= {line, *attend}, problems
    assert any("over model" in p for p in problems), problems
