"""`preflight(..., check_mesh="cpu")` beyond one process's 2,048 forced CPU
devices (issue 36 items 1 and 5): the mesh folded (its largest axis divided until
it fits), compiled with the same global shapes, and the report saying so
(`report.check_mesh_method == "folded"`, `checks.compiled_on`).

The steps are `test_preflight_cpu.py`'s. Most tests lower the limit (to 128) so
that a 256-device mesh folds, cheaply; one folds the real 4,096-device mesh.
"""

import pytest
from jax.sharding import AbstractMesh

import jaxtyping_shard as jts
from jaxtyping_shard._report import cpu_mesh

from .test_preflight_cpu import hidden, planted, pod, shapes, TYPES


@pytest.fixture
def limit_128(monkeypatch):
    monkeypatch.setattr(cpu_mesh, "MAX_DEVICES", 128)


@pytest.mark.parametrize(
    "shape, limit, compiled",
    [
        ((512, 8), 2048, (256, 8)),
        ((32, 8), 2048, (32, 8)),  # fits: itself
        ((64, 64), 2048, (32, 64)),  # the first of the largest axes
        ((8, 1024), 2048, (8, 256)),
        ((2, 3, 1031), 64, (2, 3, 1)),  # a prime axis divides by itself
        ((9, 4), 12, (3, 4)),  # by its smallest factor, 3
    ],
)
def test_the_largest_axis_is_divided_until_the_mesh_fits(
    monkeypatch, shape, limit, compiled
):
    monkeypatch.setattr(cpu_mesh, "MAX_DEVICES", limit)
    names = tuple("abc"[: len(shape)])
    mesh = AbstractMesh(shape, names)
    assert cpu_mesh.folded(mesh) == compiled
    folds = compiled != shape
    assert cpu_mesh.method(mesh) == ("folded" if folds else "one process")


@pytest.mark.parametrize("kind", list(TYPES))
def test_a_folded_compile_is_the_compile_on_the_folded_mesh(limit_128, kind):
    report = jts.preflight(hidden, *shapes(), mesh=pod(kind), check_mesh="cpu")
    assert report.check_mesh_method == "folded"
    assert report.as_dict()["check_mesh_method"] == "folded"
    said = report.checks.compiled_on
    assert said.startswith("('data': 16, 'model': 8")
    assert "128 forced CPU devices in one child process" in said
    assert "the mesh ('data': 32, 'model': 8" in said and "'data' 2x smaller" in said
    assert "estimate from above" in said and "method 'folded'" in said
    # The temporaries are those of the 16 x 8 mesh itself, compiled in one
    # process (the same compile): a device's rows of `x` twice as many.
    small = jts.preflight(hidden, *shapes(), mesh=pod(kind, (16, 8)), check_mesh="cpu")
    assert small.check_mesh_method == "one process"
    assert report.temporary_bytes == small.temporary_bytes
    assert report.temporaries[0].largest_bytes == (4096 // 16) * (4096 // 8) * 4
    # The arguments and results are counted on the real mesh, by the trace:
    # half the folded compile's rows of `x` per device.
    assert report.argument_bytes < report.xla_memory.argument_size_in_bytes
    assert report.argument_bytes == (1024 * 4096 // 8 * 4 + 4096 // 32 * 1024 * 4)
    # The unfolded axis keeps its groups: the all-reduce over `model`, 8 wide.
    rows = report.collectives.rows
    assert any(r.kind == "all-reduce" and r.axes == ("model",) for r in rows)
    assert all(r.group_size == 8 for r in rows if r.axes == ("model",))


def test_a_planted_auto_mismatch_is_caught_on_a_folded_mesh(limit_128):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(planted, *shapes(), mesh=pod("auto"), check_mesh="cpu")
    text = str(info.value)
    assert "the return value of `over_model`" in text
    assert "XLA sharded it as `float32[4096@data,1024]`" in text


def test_temporaries_over_the_budget_fail_on_a_folded_mesh(limit_128):
    fits = jts.preflight(hidden, *shapes(), mesh=pod("auto")).total_bytes + 1
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(
            hidden, *shapes(), mesh=pod("auto"), check_mesh="cpu", hbm_bytes=fits
        )
    text = str(info.value)
    assert "+ temporaries" in text and "temporary at test_preflight_cpu.py:" in text
    assert info.value.report.check_mesh_method == "folded"


def test_4096_devices_fold_to_2048_in_one_process():
    """The limit itself: 512 x 8 compiles on 256 x 8 (2,048 devices), where
    one process of 4,096 fails ("Multiprocess computations aren't implemented
    on the CPU backend")."""
    report = jts.preflight(
        hidden, *shapes(), mesh=pod("auto", (512, 8)), check_mesh="cpu"
    )
    assert report.check_mesh_method == "folded"
    assert "2,048 forced CPU devices in one child process" in report.checks.compiled_on
    assert "the mesh ('data': 512, 'model': 8; Auto axes)" in report.checks.compiled_on
    assert report.temporaries[0].largest_bytes == (4096 // 256) * (4096 // 8) * 4
    # Traced on the AbstractMesh alone: none of this is known, and said so.
    bare = jts.preflight(hidden, *shapes(), mesh=pod("auto", (512, 8)))
    assert bare.check_mesh_method is None and bare.temporary_bytes is None
