"""`jts.collectives`: each collective of a compiled program with its kind, mesh
axes by the user's names, bytes per device, source line and nearest annotated
function; merged and layout-only collectives said so; loops counted; totals.
Nothing runs, nothing moves, and JAX's compile cache is reused.
"""

import inspect
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core import compat

from .helpers import Compiles, MESHES, no_transfers, place


SOURCE = inspect.getsource(inspect.getmodule(inspect.currentframe()))  # type: ignore[arg-type]


# JAX 0.8 keeps one frame per op, with no function name: the line is all there is.
FRAMES = compat.hlo_stack_frames_usable()


def named(function, annotated=None):
    """What a source says of its function and annotated function, where known."""
    return (function, annotated) if FRAMES else ("", None)


def line_of(marker: str) -> int:
    """The line of this file that ends with `# <marker>`."""
    (line,) = [
        i
        for i, text in enumerate(SOURCE.splitlines(), 1)
        if text.endswith(f"# {marker}")
    ]
    return line


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


def shard_mapped(mesh, body, in_spec, out_spec):
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False
        )
    )


def each_kind(x):
    a = jax.lax.psum(x, "data")  # psum
    b = jax.lax.all_gather(x, "model", axis=1, tiled=True)  # all_gather
    c = jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)  # scatter
    d = jax.lax.all_to_all(x, "model", 1, 1, tiled=True)  # all_to_all
    e = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])  # ppermute
    return a, b, c, d, e


def test_each_kind_with_its_axes_bytes_and_line(mesh):
    # A local block of float32[8,4] (128 B) on each device, data=4, model=2.
    step = shard_mapped(mesh, each_kind, P("data", "model"), P("data", "model"))
    x = place(mesh, (32, 8), P("data", "model"))
    report = jts.collectives(step, x)
    rows = {r.kind: r for r in report.rows}
    assert set(rows) == {
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
    }  # fmt: skip
    expected = {  # kind: (axes, group size, bytes each device receives, marker)
        "all-reduce": (("data",), 4, 2 * 128 * 3 // 4, "psum"),
        "all-gather": (("model",), 2, 128 * 1, "all_gather"),
        "reduce-scatter": (("data",), 4, 128 * 3 // 4, "scatter"),
        "all-to-all": (("model",), 2, 128 * 1 // 2, "all_to_all"),
        "collective-permute": (("data",), 4, 128, "ppermute"),
    }
    for kind, (axes, size, moved, marker) in expected.items():
        row = rows[kind]
        assert (row.axes, row.over, row.bytes) == (axes, "+".join(axes), moved), row
        if kind != "collective-permute":
            assert row.group_size == size
        assert row.executions == 1 and not row.layout_only
        (source,) = row.sources
        assert (source.file, source.line) == ("test_collectives.py", line_of(marker))
        assert (source.function, source.annotated) == named("each_kind")
        assert source.text.endswith(f"# {marker}")
    assert report.count == 5 and report.bytes == sum(e[2] for e in expected.values())
    assert report.mesh is not None and dict(report.mesh.shape) == {
        "data": 4,
        "model": 2,
    }


@pytest.mark.parametrize("seed", range(6))
def test_axes_named_by_device_sets_on_any_mesh(seed):
    # Differential: the axes a psum / all_gather is asked to run over, on a mesh
    # of random shape, names and device order, are those reported, whatever
    # form XLA writes its groups in (lists, iota, its own reshaped mesh).
    rng = random.Random(seed)
    shape = rng.choice([(8,), (4, 2), (2, 4), (2, 2, 2)])
    names = tuple(rng.sample(["a", "b", "c", "x", "y"], len(shape)))
    devices = list(jax.devices()[:8])
    rng.shuffle(devices)
    kind = rng.choice([AxisType.Explicit, AxisType.Auto])
    mesh = Mesh(
        np.asarray(devices).reshape(shape), names, axis_types=(kind,) * len(shape)
    )
    reduced = tuple(n for n in names if rng.random() < 0.6) or names[:1]
    gathered = tuple(n for n in names if n not in reduced)
    spec = P(names)  # the leading dim split over every axis

    def body(x):
        y = jax.lax.psum(x, reduced)
        if gathered:
            y = y + jax.lax.all_gather(x, gathered, axis=0, tiled=True)[: x.shape[0]]
        return y

    step = shard_mapped(mesh, body, spec, spec)
    report = jts.collectives(step, place(mesh, (16, 3), spec))
    by_kind = {r.kind: r for r in report.rows}
    order = lambda axes: tuple(n for n in names if n in axes)  # noqa: E731
    assert by_kind["all-reduce"].axes == order(reduced), (shape, names, reduced)
    assert by_kind["all-reduce"].group_size == int(
        np.prod([mesh.shape[n] for n in reduced])
    )
    if gathered:
        assert by_kind["all-gather"].axes == order(gathered), (shape, names, gathered)
    else:
        assert "all-gather" not in by_kind


Checked = Float[Array, "b e", P("data", None)]
Summed = Float[Array, "e"]  # noqa: F821 (an alias: typeguard reads no dim strings)


@beartype
def by_beartype(x: Checked) -> Summed:
    return jnp.sum(x, axis=0)  # beartype


@jaxtyped(typechecker=None)
@typechecked
def by_typeguard(x: Checked) -> Summed:
    return jnp.sum(x * 2, axis=0)  # typeguard


@jaxtyped(typechecker=beartype)
def by_jaxtyped(x: Checked) -> Summed:
    return helper(x * 3)  # jaxtyped


def helper(x):
    return jnp.sum(x, axis=0)  # helper


def unchecked(x):
    return jnp.sum(x * 4, axis=0)  # unchecked


@jts.jit
def three_sums(x: Checked):
    return by_beartype(x) + by_typeguard(x) + by_jaxtyped(x) + unchecked(x)


def test_merged_collective_lists_each_line_and_annotated_function(mesh):
    x = place(mesh, (8, 4), P("data", None))
    with jax.set_mesh(mesh):
        report = jts.collectives(three_sums, x)
    (row,) = report.rows  # XLA merges the four sums over `data` into one
    assert row.kind == "all-reduce" and row.axes == ("data",) and row.merged
    assert row.bytes == sum(p.bytes for p in row.parts) == 4 * (2 * 16 * 3 // 4)
    found = {(s.line, (s.function, s.annotated)) for s in row.sources}
    assert found == {
        (line_of("beartype"), named("by_beartype", "by_beartype")),
        (line_of("typeguard"), named("by_typeguard", "by_typeguard")),
        (line_of("helper"), named("helper", "by_jaxtyped")),
        # Unannotated itself: the nearest annotated function is the jts.jit one.
        (line_of("unchecked"), named("unchecked", "three_sums")),
    }
    table = str(report)
    assert "merged by XLA from 4 lines" in table
    where = f"test_collectives.py:{line_of('helper')}"
    if FRAMES:
        where += " in `helper` within `by_jaxtyped`"
    assert f"{where}: return jnp.sum(x, axis=0)  # helper" in table


def test_layout_only_collectives_say_so(mesh):
    # The result must come out replicated: XLA gathers it after the last op,
    # with no source line of its own.
    step = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
    report = jts.collectives(step, place(mesh, (8, 4), P("data", "model")))
    assert report.rows and all(r.layout_only for r in report.rows)
    assert {r.kind for r in report.rows} == {"all-gather"}
    assert {a for r in report.rows for a in r.axes} == {"data", "model"}
    assert "(no source: XLA moved it for a layout of the inputs or outputs)" in str(
        report
    )


def test_collectives_in_a_loop_count_each_trip(mesh):
    def body(carry, w):
        return carry + jnp.sum(carry * w, axis=0, keepdims=True), None  # in scan

    def scanned(x, ws):
        return jax.lax.scan(body, x, ws)[0]

    x = place(mesh, (8, 4), P("data", None))
    ws = place(mesh, (3, 8, 4), P(None, "data", None))
    report = jts.collectives(scanned, x, ws)
    (row,) = report.rows
    assert (row.kind, row.axes, row.executions) == ("all-reduce", ("data",), 3)
    assert row.bytes == 3 * (2 * 16 * 3 // 4) and report.count == 3
    assert row.sources[0].line == line_of("in scan")
    assert "all-reduce x3" in str(report)


def test_totals_by_kind_and_axes_and_the_table(mesh):
    step = shard_mapped(mesh, each_kind, P("data", "model"), P("data", "model"))
    report = jts.collectives(step, place(mesh, (32, 8), P("data", "model")))
    kinds = report.by_kind()
    assert sum(t.count for t in kinds.values()) == report.count
    assert sum(t.bytes for t in kinds.values()) == report.bytes
    axes = report.by_axes()
    assert set(axes) == {r.over for r in report.rows}
    assert sum(t.bytes for t in axes.values()) == report.bytes
    table = str(report)
    assert table.splitlines()[0].startswith("collectives of `")
    assert f"{report.count} per call" in table
    for row in report.rows:
        assert row.kind in table


def test_nothing_runs_nothing_moves_and_the_compile_is_reused(mesh):
    calls = []

    def step(x):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.sum(x, axis=0)

    x = place(mesh, (8, 4), P("data", None))
    jitted = jax.jit(step)
    with no_transfers(), Compiles() as compiles:
        first = jts.collectives(step, x)  # a plain function: compiled once
        assert compiles.count == 1
        again = jts.collectives(step, x)
        assert compiles.count == 1
        jitted(x).block_until_ready()  # the same program: JAX's cache has it
        from_jit = jts.collectives(jitted, x)
        lowered = jts.collectives(jitted.lower(x))
        compiled = jts.collectives(jitted.lower(x).compile())
        assert compiles.count == 1
    assert calls == [1]  # only the real call ran the program
    for other in (again, from_jit, lowered, compiled):
        assert [(r.kind, r.axes, r.bytes) for r in other.rows] == [
            (r.kind, r.axes, r.bytes) for r in first.rows
        ]


def test_jts_jit_objects_reuse_their_compile(mesh):
    def apply(x: Checked) -> Float[Array, "e", P()]:  # noqa: F821
        return jnp.sum(x, axis=0)

    x = place(mesh, (8, 4), P("data", None))
    for step in (
        jts.jit(apply),
        jts.jit(apply, in_shardings="annotations", out_shardings="annotations"),
    ):
        with jax.set_mesh(mesh), no_transfers(), Compiles() as compiles:
            step(x)
            called = compiles.count
            report = jts.collectives(step, x)
            assert compiles.count == called == 1
        assert [r.kind for r in report.rows] == ["all-reduce"]
        assert report.function.endswith(".<locals>.apply")


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="collectives: expected a function"):
        jts.collectives(42)


Stored = Float[Array, "embed hidden", jts.Logical("embed", "hidden")]
Used = Float[Array, "embed hidden", jts.Logical(None, "hidden")]


@jaxtyped(typechecker=beartype)
def use_weight(x: Float[Array, "batch embed", P("data", None)], w: Stored):
    return x @ jts.reshard(w, Used)  # use_weight


def test_the_report_follows_the_rules_through_jaxs_caches(mesh):
    # The rules table is part of JAX's cache keys: a new table is a new program
    # (and a new report); going back finds the first compile again.
    x = place(mesh, (8, 16), P("data", None))
    w = place(mesh, (16, 8), P("data", "model"))
    w_whole = place(mesh, (16, 8), P(None, "model"))
    fsdp = {"embed": "data", "hidden": "model"}
    whole = {"embed": None, "hidden": "model"}
    step = jax.jit(use_weight)
    with jax.set_mesh(mesh), Compiles() as compiles:
        with jts.axis_rules(fsdp):
            first = jts.collectives(step, x, w)
        with jts.axis_rules(whole):
            second = jts.collectives(step, x, w_whole)
        assert compiles.count == 2
        with jts.axis_rules(fsdp):
            again = jts.collectives(step, x, w)
        assert compiles.count == 2
    gathers = [r for r in first.rows if r.kind == "all-gather"]
    assert [(r.axes, r.sources[0].line) for r in gathers] == [
        (("data",), line_of("use_weight"))
    ]
    assert not [r for r in second.rows if r.kind == "all-gather"]
    assert str(again) == str(first)


def test_jax_08_guesses_the_users_frame_outside_this_package():
    # JAX 0.8's only source line per op is its guess of the user's frame: this
    # package's files are excluded from it there, and only there (later JAX
    # keeps every frame, ours included, to tell annotated functions).
    from jax._src import source_info_util

    package = os.path.dirname(jts.__file__) + os.sep
    assert source_info_util.is_user_filename(package + "x.py") == FRAMES
    assert source_info_util.is_user_filename(__file__)
