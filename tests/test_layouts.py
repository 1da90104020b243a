"""`jts.layouts`: every intermediate's layout by line and function, held to a
JSON baseline. Explicit meshes read the trace's types, Auto meshes the
shardings XLA propagated (without adding an op to the program). An
intermediate laid out anew fails naming its line and both layouts; a comment
above the step or an edit to a function the step does not call stays quiet;
a step with nothing to hold, or layouts not read, says so.
"""

import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import MESHES, P, run_child_pytest


FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: functions are known

PROGRAM = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
{above}

def unrelated(x):
    return {unrelated}


def step(x, w):
    h = {matmul}
    h = jax.nn.relu(h)

    def body(c, _):
        return c * 2, None

    h, _ = jax.lax.scan(body, h, None, length=3)
    return (h * h).sum(0)
"""

MATMUL = {
    "explicit": 'jnp.matmul(x, w, out_sharding=P("data", {model}))',
    "auto": 'jax.lax.with_sharding_constraint(x @ w, P("data", {model}))',
}
LINE = "h = " + MATMUL["auto"].split("(")[0]


def program(kind, model='"model"', above="", unrelated="x + 1"):
    matmul = MATMUL[kind].format(model=model)
    return PROGRAM.format(above=above, unrelated=unrelated, matmul=matmul)


def load(tmp_path, name, source):
    path = tmp_path / name / "prog.py"
    path.parent.mkdir()
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"layouts_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(params=["explicit", "auto"])
def kind(request):
    return request.param


def inputs(mesh, x_spec=P("data", None)):
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, x_spec))
    w = jax.ShapeDtypeStruct(
        (4, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    return x, w


def report_of(step, kind, *args):
    mesh = MESHES[kind]()
    with jax.set_mesh(mesh):
        return jts.layouts(step, *(args or inputs(mesh)))


def test_rows_name_line_function_operation_and_layout(tmp_path, kind):
    module = load(tmp_path, "v1", program(kind))
    report = report_of(module.step, kind)
    assert report.source == ("types" if kind == "explicit" else "xla")
    (matmul,) = [
        r for r in report.rows if r.op in ("dot_general", "sharding_constraint")
    ][-1:]
    assert matmul.layout == "float32[8@data,8@model]"
    assert matmul.site is not None and matmul.site.text.startswith("h = ")
    body = report.where(op="mul", line="c * 2")
    assert body.rows and {r.layout for r in body.rows} == {"float32[8@data,8@model]"}
    if kind == "explicit" or FRAMES:
        assert body.rows[0].function == "step.<locals>.body"
    (total,) = report.where(op="reduce_sum").rows
    assert total.layout == "float32[8@model]" and total.shape == "float32[8]"
    assert re.search(r"float32\[8@data,8@model\] +mul +prog.py:\d+", str(report))


def test_baseline_is_quiet_across_unrelated_edits(tmp_path, kind):
    path = tmp_path / "layouts.json"
    report_of(load(tmp_path, "v1", program(kind)).step, kind).save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "jaxtyping_shard layouts baseline 1"
    section = data["jax"][jax.__version__]
    assert section["mesh"] == {"data": 4, "model": 2}
    assert section["from"] == ("types" if kind == "explicit" else "xla")
    wheres = [e["where"] for e in section["layouts"]]
    assert wheres and not any(re.search(r"\.py:\d", w) for w in wheres)  # no numbers
    edited = program(kind, above="# a comment\n\n\n", unrelated="x * 3 - 1")
    report_of(load(tmp_path, "v2", edited).step, kind).check(path)  # quiet


def test_an_intermediate_laid_out_anew_is_caught_naming_its_line(tmp_path, kind):
    path = tmp_path / "layouts.json"
    report_of(load(tmp_path, "v1", program(kind)).step, kind).save(path)
    changed = load(tmp_path, "v2", program(kind, model="None"))
    report = report_of(changed.step, kind)
    line = next(
        i
        for i, text in enumerate(
            (tmp_path / "v2" / "prog.py").read_text().splitlines(), 1
        )
        if text.strip().startswith("h = ")
        and ("matmul" in text or "constraint(x" in text)
    )
    with pytest.raises(jts.LayoutChangeError) as caught:
        report.check(path)
    message = str(caught.value)
    assert message.startswith("`step`: ")
    assert "laid out anew: " in message
    assert re.search(
        rf"prog.py:{line}( in `step`)?: h = .*: float32\[8@data,8@model\] -> "
        r"float32\[8@data,8\]",
        message,
    ), message
    assert "pytest --update-layouts" in message and "report.save(" in message


def test_jit_wrapped_and_plain_steps_agree(tmp_path, kind):
    module = load(tmp_path, "v1", program(kind))
    plain = report_of(module.step, kind)
    for wrapped in (jax.jit(module.step), jts.jit(module.step)):
        got = report_of(wrapped, kind)
        assert [(r.key, r.layout) for r in got.rows] == [
            (r.key, r.layout) for r in plain.rows
        ]
        assert got.function == "step"


def test_value_and_grad_step_has_its_backward_layouts(tmp_path, kind):
    source = program(kind) + (
        "\n\ndef loss(w, x):\n    return step(x, w).sum()\n\n\n"
        "grad_step = jax.jit(jax.value_and_grad(loss))\n"
    )
    module = load(tmp_path, "grad", source)
    mesh = MESHES[kind]()
    x, w = inputs(mesh)
    with jax.set_mesh(mesh):
        report = jts.layouts(module.grad_step, w, x)
    path = tmp_path / "grad.json"
    report.save(path)
    report.check(path)
    # The backward pass: a matmul for the weight's gradient, laid out as `w`.
    assert "float32[4,8@model]" in {r.layout for r in report.rows}, str(report)
    assert len(report.rows) > len(report_of(module.step, kind).rows)


def test_through_jax_caches_a_new_input_layout_is_caught(tmp_path, kind):
    mesh = MESHES[kind]()
    step = jax.jit(lambda a: jnp.sin(a) * 2)
    path = tmp_path / "layouts.json"
    x, _ = inputs(mesh)
    moved, _ = inputs(mesh, P(None, "data"))
    with jax.set_mesh(mesh):
        step(jax.device_put(jnp.ones((8, 4)), x.sharding))  # warm
        jts.layouts(step, x).save(path)
        jts.layouts(step, x).check(path)  # the same: quiet
        step(jax.device_put(jnp.ones((8, 4)), moved.sharding))
        report = jts.layouts(step, moved)
    with pytest.raises(jts.LayoutChangeError) as caught:
        report.check(path)
    assert "laid out anew: sin at test_layouts.py:" in str(caught.value)
    assert "float32[8@data,4] -> float32[8,4@data]" in str(caught.value)


def test_a_step_with_no_intermediates_says_so(tmp_path, kind):
    mesh = MESHES[kind]()
    x, _ = inputs(mesh)
    with jax.set_mesh(mesh):
        report = jts.layouts(lambda a: a, x)
    assert report.rows == ()
    assert "none: the step makes no intermediate" in str(report)
    report.save(tmp_path / "empty.json")
    with pytest.raises(jts.LayoutChangeError, match="no intermediates"):
        report.check(tmp_path / "empty.json")


def test_a_baseline_without_this_release_says_so(tmp_path):
    path = tmp_path / "old.json"
    module = load(tmp_path, "v1", program("explicit"))
    report = report_of(module.step, "explicit")
    report.save(path)
    data = json.loads(path.read_text())
    data["jax"] = {"0.0.1": data["jax"][jax.__version__]}
    path.write_text(json.dumps(data))
    with pytest.raises(jts.LayoutChangeError, match=r"no baseline for JAX .* 0\.0\.1"):
        report.check(path)
    report.save(path)  # adds this release's section, keeps the other
    assert set(json.loads(path.read_text())["jax"]) == {"0.0.1", jax.__version__}
    report.check(path)
    with pytest.raises(jts.LayoutChangeError, match="no baseline at"):
        report.check(tmp_path / "missing.json")


FIXTURE_TEST = """
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts


def step(x):
    return jax.lax.with_sharding_constraint(x * 2, P({spec}))


def test_layouts(check_layouts):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct(
        (8, 8), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    with jax.set_mesh(mesh):
        check_layouts(jts.layouts(step, x), "layouts.json")
"""


def run_pytest(tmp_path, spec, *args):
    source = FIXTURE_TEST.format(spec=spec)
    return run_child_pytest(tmp_path, source, "--jax-cpu-devices", "8", *args)


def test_fixture_and_update_option(tmp_path):
    out = run_pytest(tmp_path, '"data"', "--update-layouts")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "jaxtyping_shard: rewrote the baseline of layouts layouts.json" in out.stdout
    assert json.loads((tmp_path / "layouts.json").read_text())["function"] == "step"
    assert run_pytest(tmp_path, '"data"').returncode == 0
    out = run_pytest(tmp_path, "None, 'data'")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "LayoutChangeError" in out.stdout
    assert re.search(
        r"test_step.py:10( in `step`)?: return jax.lax.with_sharding", out.stdout
    )
    assert "float32[8@data,8] -> float32[8,8@data]" in out.stdout


NESTED = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@jax.custom_vjp
def scaled(x):
    return x * 3.0  # custom_vjp


scaled.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 3.0,))


def step(x):
    a = jax.lax.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, x)
    b = jax.checkpoint(lambda v: jnp.sin(v) * 2)(a)
    c = scaled(b)
    return jax.shard_map(lambda v: v * 5, in_specs=P("data"), out_specs=P("data"))(c)
"""


def test_inside_cond_remat_custom_vjp_and_shard_map(tmp_path, kind):
    module = load(tmp_path, "nested", NESTED)
    mesh = MESHES[kind]()
    x, _ = inputs(mesh)
    with jax.set_mesh(mesh):
        report = jts.layouts(module.step, x)
    by_text = {}
    for row in report.rows:
        if row.site is not None:
            by_text.setdefault(row.site.text.split(" = ")[0], set()).add(row.layout)
    for line in ("a", "b", "return x * 3.0  # custom_vjp"):
        arrays = {t for t in by_text.get(line, ()) if not t.endswith("[]")}
        assert arrays == {"float32[8@data,4]"}, (line, str(report))  # no scalars
    assert report.where(op="sin").rows and report.where(op="add").rows
    # Inside `shard_map`: each device's shard, said as such.
    inside = [
        r
        for r in report.rows
        if r.layout.endswith("{manual}") and not r.shape.endswith("[]")
    ]
    assert inside and all(r.layout.startswith("float32[2,4]") for r in inside)
    assert not report.unread
