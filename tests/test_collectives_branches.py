"""`jts.collectives` on `lax.cond` / `lax.switch`: a call runs one branch, so
each collective in a branch says which (of which conditional, at which line),
and the totals, per kind and per axes, the baseline's and the budget's, are
what a call runs at most: of each conditional, its largest branch (issue 33,
item 5). Explicit and Auto meshes."""

import inspect
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import MESHES, place


SOURCE = inspect.getsource(inspect.getmodule(inspect.currentframe()))  # type: ignore[arg-type]


HERE = "test_collectives_branches.py"


def line_of(marker: str) -> int:
    (line,) = [
        i
        for i, text in enumerate(SOURCE.splitlines(), 1)
        if text.endswith(f"# {marker}")
    ]
    return line


# JAX 0.8 keeps one frame per op: a collective's line is its branch's switch.
FRAMES = compat.hlo_stack_frames_usable()


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


# A local block of float32[2,2] (16 B) on each device; data=4, model=2. Moved by
# each device: an all-reduce over 4, 2 * 16 * 3 / 4 = 24 B; over 2, 16 B; an
# all-gather over 2, 16 B.
def gathers(x):
    return jax.lax.all_gather(x, "model", axis=1, tiled=True)[:, :2]  # gather


def reduces_twice(x, flag):
    x = jax.lax.psum(x, "data")  # data twice
    return jax.lax.cond(  # nested cond
        flag > 0,
        lambda x: jax.lax.psum(x, "data"),  # data nested
        lambda x: x,
        x,
    )


def body(x, i):
    x = jax.lax.psum(x, "model")  # always
    branches = [lambda x: reduces_twice(x, i), gathers, lambda x: x * 2]
    return jax.lax.switch(i, branches, x)  # the switch


def step_on(mesh):
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("data", "model"), P()),
            out_specs=P("data", "model"),
            check_vma=False,
        )
    )


def test_each_branch_is_named_and_the_totals_are_at_most(mesh, tmp_path):
    x = place(mesh, (8, 4), P("data", "model"))
    i = place(mesh, (), P(), jnp.int32)
    report = jts.collectives(step_on(mesh), x, i)
    # By what they do (JAX 0.8 gives an op in a branch the line of the switch).
    by_what = {(r.kind, r.over, len(r.branches)): r for r in report.rows}
    always = by_what["all-reduce", "model", 0]
    gather = by_what["all-gather", "model", 1]
    twice = by_what["all-reduce", "data", 1]
    nested = by_what["all-reduce", "data", 2]
    assert len(report.rows) == 4
    if FRAMES:
        marked = {"always": always, "gather": gather, "data twice": twice}
        for marker, row in {**marked, "data nested": nested}.items():
            assert row.sources[0].line == line_of(marker)
    assert always.bytes == 16
    switch = line_of("the switch")
    for row, index in ((gather, 1), (twice, 0), (nested, 0)):
        outer = row.branches[0]
        assert (outer.index, outer.count, outer.source.line) == (index, 3, switch)
    assert len(gather.branches) == len(twice.branches) == 1
    (_, inner) = nested.branches  # the `lax.cond` inside branch 0: its true one
    assert (inner.index, inner.count) == (1, 2)
    nested_at = line_of("nested cond") if FRAMES else switch
    assert inner.source.line == nested_at
    assert gather.bytes == 16 and twice.bytes == nested.bytes == 24
    # A call runs `always` and one branch: branch 0 with its nested cond taken
    # (2 collectives, 48 B) is the most; summing every branch would say 4, 80 B.
    assert report.count == 1 + 2 and report.bytes == 16 + 48
    assert sum(r.executions for r in report.rows) == 4
    kinds = report.by_kind()
    assert kinds["all-reduce"].count == 3 and kinds["all-reduce"].bytes == 64
    assert kinds["all-gather"].count == 1 and kinds["all-gather"].bytes == 16
    assert report.by_axes()["data"].count == 2
    assert report.where(kind="all-gather").count == 1
    assert (
        report.branched and not report.where(axes="model", kind="all-reduce").branched
    )
    table = str(report)
    assert "at most 3 per call, at most 64 B per device" in table
    row_text = next(line for line in table.splitlines() if "all-gather" in line)
    assert f"[in branch 1 of 3 of the conditional at {HERE}:{switch}" in row_text
    nested_text = next(line for line in table.splitlines() if ", within" in line)
    assert (
        f"branch 1 of 2 of the conditional at {HERE}:{nested_at}, within branch 0 of 3"
        in nested_text
    )
    # The baseline holds each line as its branch runs it, and the call's totals
    # at most; a budget of the most a call moves holds.
    path = tmp_path / "collectives.json"
    report.save(path)
    (section,) = json.loads(path.read_text())["jax"].values()
    assert (section["arrays"], section["bytes"]) == (3, 64)
    assert sum(e["bytes"] for e in section["collectives"]) == 80
    report.check(path, max_bytes=64)
    with pytest.raises(jts.CollectiveBudgetError, match="over the bound of 63 B"):
        report.check(max_bytes=63)


def test_a_new_collective_in_a_branch_is_named_with_its_branch(mesh, tmp_path):
    x = place(mesh, (8, 4), P("data", "model"))
    i = place(mesh, (), P(), jnp.int32)
    path = tmp_path / "collectives.json"
    only = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "model"),
            mesh=mesh,
            in_specs=P("data", "model"),
            out_specs=P("data", "model"),
            check_vma=False,
        )
    )
    jts.collectives(only, x).save(path)
    with pytest.raises(jts.CollectiveBudgetError) as info:
        jts.collectives(step_on(mesh), x, i).check(path)
    text = str(info.value)
    assert (
        f"in branch 1 of 3 of the conditional at {HERE}:{line_of('the switch')}" in text
    )
