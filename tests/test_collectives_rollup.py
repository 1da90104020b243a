"""The module tree of a collectives report (issue 37, item 2): the roll-up by
module path and by annotated function adds up to the flat totals exactly; the
forward / backward split of a `value_and_grad` step has both passes (and a
forward-only function none of the backward); each part's layout before and
after; `to_json()` round-trips; the text at each level of detail. On a pure
function whose every matmul goes through one helper, on Explicit and Auto
meshes; the reference step, the NNX example and the Linen model are in
`test_collectives_rollup_examples.py`.
"""

import json

import jax
import pytest
from jax.sharding import NamedSharding

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat
from jaxtyping_shard._report import rollup as _rollup

from .helpers import MESHES, P, place
from .test_collectives_budget import load


FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: stacks are known

PROGRAM = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

EXPLICIT = EXPLICIT_MESH  # an Explicit mesh: each product says its result's layout


def dense(x, w, out):
    return jnp.einsum("bi,io->bo", x, w, out_sharding=out if EXPLICIT else None)


def mlp(params, x):
    h = dense(x, params["w_in"], P("data", "model"))  # column-parallel: no comm
    return dense(h, params["w_out"], P("data", None))  # row-parallel: summed


def loss(params, x):
    return mlp(params, x).sum()


def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda g: g * 0.5, grads)
"""


def program(tmp_path, name, kind):
    return load(
        tmp_path, name, PROGRAM.replace("EXPLICIT_MESH", str(kind == "explicit"))
    )


@pytest.fixture(params=["explicit", "auto"])
def kind(request):
    return request.param


def arguments(mesh):
    params = {
        "w_in": place(mesh, (16, 32), P(None, "model")),
        "w_out": place(mesh, (32, 16), P("model", None)),
    }
    return params, place(mesh, (8, 16), P("data", None))


def adds_up(report):
    """The roll-ups and the per-pass totals add up to the flat totals."""
    for by in ("path", "annotated"):
        root = report.rollup(by=by)
        assert (root.count, root.bytes) == (report.count, report.bytes)
        for node in root.walk():
            assert node.count == sum(t.count for t in node.passes.values())
            assert node.bytes == sum(t.bytes for t in node.passes.values())
            assert sum(c.count for c in node.children) <= node.count
            assert sum(c.bytes for c in node.children) <= node.bytes
    passes = report.by_phase()
    assert set(passes) == {"forward", "backward", "other"}
    assert sum(t.count for t in passes.values()) == report.count
    assert sum(t.bytes for t in passes.values()) == report.bytes
    every = sum(p.bytes for r in report.rows for p in r.parts)
    assert every == report.bytes if not report.branched else every >= report.bytes
    return report.rollup()


def test_a_value_and_grad_step_splits_forward_and_backward(tmp_path, kind):
    module = program(tmp_path, "vg", kind)
    mesh = MESHES[kind]()
    params, x = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(module.step, params, x)
    root = adds_up(report)
    assert report.count > 0
    forward = [p for r in report.rows for p in r.parts if p.phase == "forward"]
    backward = [p for r in report.rows for p in r.parts if p.phase == "backward"]
    assert forward and backward
    # The forward pass's row-parallel product sums over `model`, in the jvp.
    assert any(r.over == "model" and r.phase == "forward" for r in report.rows)
    assert all("transpose(" not in p.op_name for p in forward)
    assert all("transpose(" in p.op_name for p in backward)
    assert root.forward.count and root.backward.count
    assert {r.phase for r in report.rows} <= {"forward", "backward", "other", "mixed"}
    if FRAMES:
        # Function names nested by the call chain, the helper last.
        found = {".".join(p.path) for r in report.rows for p in r.parts}
        assert "loss.mlp.dense" in found, found
        node = root.find("loss.mlp.dense")
        assert node is not None and node.forward.count >= 1
        assert root.find("loss.mlp").count >= node.count
    else:
        # JAX 0.8 keeps one frame per op and no functions: every part at the root.
        assert all(p.path == () for r in report.rows for p in r.parts)
        assert root.children == ()


def test_a_forward_only_function_has_no_backward(tmp_path, kind):
    module = program(tmp_path, "fwd", kind)
    mesh = MESHES[kind]()
    params, x = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(module.mlp, params, x)
    adds_up(report)
    assert report.count > 0
    assert {p.phase for r in report.rows for p in r.parts} == {"forward"}
    passes = report.by_phase()
    assert passes["backward"].count == passes["other"].count == 0
    assert passes["forward"].count == report.count
    if FRAMES:
        assert report.rollup().find("dense").count == report.count


def test_layouts_before_and_after_in_jax_notation(kind):
    mesh = MESHES[kind]()
    x = place(mesh, (8, 4), P("data", None))
    gather = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        report = jts.collectives(gather, x)
    (row,) = report.where(kind="all-gather").rows
    (part,) = row.parts
    assert (part.before, part.after) == ("float32[8@data,4]", "float32[8,4]")
    assert "float32[8@data,4] -> float32[8,4]" in report.table(detail="frames")
    assert "float32[8@data,4]" not in str(report)  # the default table unchanged

    def total(x):
        return x.sum(axis=0)

    with jax.set_mesh(mesh):
        summed = jts.collectives(total, x)
    (row,) = summed.where(kind="all-reduce").rows
    assert (row.parts[0].before, row.parts[0].after) == (
        "float32[4]{U:data}",
        "float32[4]",
    )


def test_layout_of_each_kind():
    assert _rollup.phase("jit(f)/transpose(jvp(g))/dot_general", True) == "backward"
    assert _rollup.phase("jit(f)/jvp(g)/dot_general", True) == "forward"
    assert _rollup.phase("jit(f)/reduce_sum", True) == "other"
    assert _rollup.phase("jit(f)/reduce_sum", False) == "forward"
    from jaxtyping_shard._report.operand_layout import layouts

    assert layouts("reduce-scatter", "f32", (8, 4), 0, ("data",), 4) == (
        "float32[8,4]{U:data}",
        "float32[8@data,4]",
    )
    assert layouts("all-gather", "bf16", (2, 4), 1, ("data", "model"), 8) == (
        "bfloat16[2,32@(data,model)]",
        "bfloat16[2,32]",
    )
    assert layouts("collective-permute", "f32", (2,), None, ("data",), 4) == (
        "float32[2]",
        "float32[2]",
    )


def test_to_json_round_trips(tmp_path, kind):
    module = program(tmp_path, "js", kind)
    mesh = MESHES[kind]()
    params, x = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(module.step, params, x)
    text = report.to_json()
    assert isinstance(text, str)
    data = json.loads(text)
    assert data["format"] == "jaxtyping_shard collectives report 1"
    assert data["function"] == "step" and data["jax"] == jax.__version__
    assert data["mesh"]["axes"] == {"data": 4, "model": 2}
    assert (data["count"], data["bytes"]) == (report.count, report.bytes)
    assert len(data["rows"]) == len(report.rows)
    for row, got in zip(report.rows, data["rows"]):
        assert (got["kind"], got["over"], got["bytes"]) == (
            row.kind,
            row.over,
            row.bytes,
        )
        assert got["axes"] == list(row.axes) and got["phase"] == row.phase
        assert [p["before"] for p in got["parts"]] == [p.before for p in row.parts]
        assert [p["phase"] for p in got["parts"]] == [p.phase for p in row.parts]
        for part, js in zip(row.parts, got["parts"]):
            if part.source is not None:
                assert js["source"]["line"] == part.source.line
                assert js["site"]["key"] == list(part.site.key)
    assert data["rollup"] == report.rollup().to_dict()
    assert data["rollup"]["count"] == report.count
    assert sum(t["count"] for t in data["by_phase"].values()) == report.count
    assert json.loads(json.dumps(data)) == data


def test_detail_levels_differ_and_hold_what_they_claim(tmp_path):
    module = program(tmp_path, "dl", "explicit")
    mesh = MESHES["explicit"]()
    params, x = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(module.step, params, x)
    levels = {
        d: report.table(detail=d) for d in ("summary", "modules", "rows", "frames")
    }
    assert len(set(levels.values())) == 4
    assert report.table() == levels["rows"] == str(report)
    head = str(report).splitlines()[0]
    for text in levels.values():
        assert text.splitlines()[0] == head
        assert "by kind:" in text
    assert "by pass: forward" in levels["summary"]
    assert "kind " not in levels["summary"]  # no table of rows
    assert "by module path:" in levels["modules"]
    assert str(report.rollup()) in levels["modules"]
    for row in report.rows:
        for part in row.parts:
            assert f"{part.before} -> {part.after}" in levels["frames"]
    if FRAMES:
        assert "prog.py" in levels["frames"] and "(dense)" in levels["frames"]
        assert "    dense: " in levels["modules"]
    with pytest.raises(ValueError, match="detail='everything'"):
        report.table(detail="everything")
    with pytest.raises(ValueError, match="by='module'"):
        report.rollup(by="module")


def test_a_conditional_counts_the_branch_the_totals_count(kind):
    mesh = MESHES[kind]()
    x = place(mesh, (8, 4), P("data", None))

    def step(x, flag):
        big = jax.lax.cond(flag, lambda x: x.sum(0), lambda x: x.sum(0) * 2, x)
        other = jax.lax.cond(flag, lambda x: x.sum(), lambda x: x.sum() + x.max(), x)
        return big, other

    with jax.set_mesh(mesh):
        report = jts.collectives(step, x, True)
    assert report.branched
    assert sum(r.executions for r in report.rows) > report.count  # a bound
    adds_up(report)
