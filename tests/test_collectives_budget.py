"""A step held to its budget of collectives: the baseline file (what it holds, and
what it leaves out so that an edit elsewhere changes nothing; one section per
JAX release), every new or grown line named, bounds on bytes, forbidden
selections, and the pytest fixture with `--update-collectives`.
"""

import importlib.util
import json
import re

import jax
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import MESHES, P, place, run_child_pytest


FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: functions are known


PROGRAM = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def gather_weights(w):
    {gather}


def step(x, w):
    total = jnp.sum(x, axis=0)  # over the batch
    {extra}
    return total + gather_weights(w).sum(axis=0)
"""


def load(tmp_path, name, source):
    path = tmp_path / name / "prog.py"
    path.parent.mkdir()
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"collectives_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture
def mesh():
    return MESHES["explicit"]()


def report_of(module, mesh, cols=4):
    x = place(mesh, (8, cols), P("data", None))
    w = place(mesh, (8, cols), P("data", None))
    with jax.set_mesh(mesh):
        return jts.collectives(module.step, x, w)


GATHER = "return jax.sharding.reshard(w * 2, P())  # the weight, whole"


def program(extra="pass", above=""):
    return above + PROGRAM.format(extra=extra, gather=GATHER)


def test_baseline_holds_lines_by_text_not_number(tmp_path, mesh):
    report = report_of(load(tmp_path, "v1", program()), mesh)
    path = tmp_path / "budget.json"
    report.save(path)
    text = path.read_text()
    data = json.loads(text)
    assert data["format"] == "jaxtyping_shard collectives baseline 2"
    assert data["function"] == "step"
    section = data["jax"][jax.__version__]
    assert section["mesh"] == {"data": 4, "model": 2}
    wheres = {(e["kind"], e["over"], e["where"]) for e in section["collectives"]}
    assert wheres == {
        ("all-reduce", "data", "prog.py: total = jnp.sum(x, axis=0)  # over the batch"),
        ("all-gather", "data", "prog.py: " + GATHER),
    }
    assert section["bytes"] == report.bytes
    assert section["arrays"] == sum(e["arrays"] for e in section["collectives"])
    assert str(tmp_path) not in text  # no absolute paths
    report.save(path)
    assert path.read_text() == text  # stable
    report.check(path)

    # Lines added above: every line number changes, the baseline does not.
    moved = report_of(load(tmp_path, "v2", program(above="# a\n# b\n\n")), mesh)
    assert [s.line for r in moved.rows for s in r.sources] == [
        s.line + 3 for r in report.rows for s in r.sources
    ]
    moved.check(path)
    moved.save(path)
    assert path.read_text() == text


def test_a_new_line_is_named_with_its_number(tmp_path, mesh):
    path = tmp_path / "budget.json"
    report_of(load(tmp_path, "v1", program()), mesh).save(path)
    changed = load(tmp_path, "v2", program("total = total + jnp.sum(x * 3, axis=0)"))
    report = report_of(changed, mesh)
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(path)
    assert isinstance(caught.value, AssertionError)  # a test fails on it
    text = str(caught.value)
    line = changed.step.__code__.co_firstlineno + 2
    assert (
        "`step`: 1 problem(s) with its collectives on mesh ('data': 4, 'model': 2)"
        in text
    )
    assert (
        f"1. new: all-reduce over data, 1 array, 24 B per device, at prog.py:{line}"
    ) in text
    assert "total = total + jnp.sum(x * 3, axis=0)" in text
    assert "pytest --update-collectives" in text and "report.save(" in text


def test_grown_is_named_and_shrunk_passes(tmp_path, mesh):
    path = tmp_path / "budget.json"
    module = load(tmp_path, "v1", program())
    report_of(module, mesh, cols=4).save(path)
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report_of(module, mesh, cols=8).check(path)
    text = str(caught.value)
    assert "2 problem(s)" in text
    assert re.search(
        r"grown: all-gather over data at prog.py:\d+( in `gather_weights`)?: return "
        r".*: 1 array -> 1 array, 96 B -> 192 B per device",
        text,
    )
    assert re.search(
        r"grown: all-reduce over data at prog.py:\d+( in `step`)?: total = .*: "
        r"1 array -> 1 array, 24 B -> 48 B per device",
        text,
    )
    report_of(module, mesh, cols=2).check(path)  # less than the baseline: passes


def test_what_the_baseline_lacks_is_said(tmp_path, mesh):
    report = report_of(load(tmp_path, "v1", program()), mesh)
    missing = tmp_path / "none.json"
    with pytest.raises(jts.CollectiveBudgetError, match="no baseline at .*none.json"):
        report.check(missing)
    other = tmp_path / "other.json"
    report.save(other)
    data = json.loads(other.read_text())
    data["jax"] = {"0.0.1": data["jax"][jax.__version__]}
    other.write_text(json.dumps(data))
    with pytest.raises(
        jts.CollectiveBudgetError,
        match=rf"no baseline for JAX {jax.__version__} .* \(it holds 0.0.1\)",
    ):
        report.check(other)
    report.check(other, update=True)  # adds this release, keeps the other
    assert set(json.loads(other.read_text())["jax"]) == {"0.0.1", jax.__version__}
    report.check(other)
    data = json.loads(other.read_text())
    data["jax"][jax.__version__]["mesh"] = {"data": 8}
    other.write_text(json.dumps(data))
    with pytest.raises(jts.CollectiveBudgetError, match="taken on mesh {'data': 8}"):
        report.check(other)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="is not a baseline of collectives"):
        report.check(bad)


def test_bounds_on_bytes_and_forbidden_selections(tmp_path, mesh):
    report = report_of(load(tmp_path, "v1", program()), mesh)
    report.check(max_bytes=report.bytes)
    with pytest.raises(
        jts.CollectiveBudgetError,
        match=r"over the bound of 16 B; the largest: all-gather over data at prog.py",
    ):
        report.check(max_bytes=16)
    report.check(forbid=[{"kind": "all-to-all"}, {"axes": "model"}])
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(forbid=[{"kind": "all-reduce", "axes": "data"}])
    text = str(caught.value)
    assert (
        "forbidden (kind='all-reduce', axes='data'): all-reduce over data, at " in text
    )
    assert re.search(r"at prog.py:\d+( in `step`)?: total = .*# over the batch", text)
    with pytest.raises(TypeError, match="each item is a dict of `where`'s keywords"):
        report.check(forbid=["all-gather"])  # type: ignore[list-item]


def test_where_selects_by_kind_and_axes(tmp_path, mesh):
    report = report_of(load(tmp_path, "v1", program()), mesh)
    assert [r.kind for r in report.where(kind="all-gather").rows] == ["all-gather"]
    assert report.where(kind=("all-gather", "all-reduce")).count == 2
    assert report.where(axes="data").count == report.count == 2
    assert report.where(axes=("data", "model")).count == 0
    with pytest.raises(ValueError, match="'all_gather'.* the kinds are all-gather"):
        report.where(kind="all_gather")
    with pytest.raises(ValueError, match=r"\['batch'\] is not an axis of the mesh"):
        report.where(axes="batch")


def test_selections_by_function(tmp_path, mesh):
    report = report_of(load(tmp_path, "v1", program()), mesh)
    if not FRAMES:  # JAX 0.8: no functions in the compiled program; said so
        with pytest.raises(ValueError, match="selecting by function needs the frames"):
            report.where(inside="gather_weights")
        return
    assert [r.kind for r in report.where(inside="gather_weights").rows] == [
        "all-gather"
    ]
    assert [r.kind for r in report.where(outside="gather_weights").rows] == [
        "all-reduce"
    ]
    assert report.where(inside="prog.gather_weights").count == 0  # not a qualname
    # Lines directly in a function, not in those it calls.
    assert [r.kind for r in report.where(inside="step").rows] == ["all-reduce"]
    # No all-gather over `data` outside the function that gathers weights.
    rule = {"kind": "all-gather", "axes": "data", "outside": "gather_weights"}
    report.check(forbid=[rule])
    with pytest.raises(jts.CollectiveBudgetError, match=r"forbidden \(kind='all-red"
                       r"uce', outside=\['gather_weights'\]\): all-reduce over data, "
                       r"at prog.py:\d+ in `step`: total"):  # fmt: skip
        report.check(forbid=[{"kind": "all-reduce", "outside": ["gather_weights"]}])


FIXTURE_TEST = """
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts


def step(x):
    return jnp.sum(x, axis=0){extra}


def test_budget(check_collectives):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    check_collectives(jts.collectives(step, x), "budget.json")
"""


def run_pytest(tmp_path, extra, *args):
    source = FIXTURE_TEST.format(extra=extra)
    return run_child_pytest(tmp_path, source, "--jax-cpu-devices", "8", *args)


def test_fixture_and_update_option(tmp_path):
    out = run_pytest(tmp_path, "", "--update-collectives")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "jaxtyping_shard: rewrote the baseline of collectives budget.json" in out.stdout
    )
    assert json.loads((tmp_path / "budget.json").read_text())["function"] == "step"
    out = run_pytest(tmp_path, " + jnp.sum(x * x, axis=0)")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CollectiveBudgetError" in out.stdout
    assert "new: all-reduce over data" in out.stdout
    assert re.search(
        r"test_step.py:10( in `step`)?: return jnp.sum\(x, axis=0\) \+ jnp.sum\(x \* x",
        out.stdout,
    )
