"""`jts.preflight` on `Auto` (and mixed) mesh axes: what the trace can check, what
only XLA's partitioner can (run on `check_mesh`), and never an "all clear" for
what did not run."""

import re

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


KINDS = {
    "auto": (AxisType.Auto, AxisType.Auto),
    "mixed": (AxisType.Explicit, AxisType.Auto),  # as helpers.mixed_mesh
}
Rows = Float[Array, "b@data e"]
Cols = Float[Array, "b e@model"]
Both = Float[Array, "b@data e@model"]  # differs from Rows on `model` only


@pytest.fixture(params=list(KINDS))
def kind(request):
    return request.param


def pod(kind):
    return AbstractMesh((512, 8), ("data", "model"), axis_types=KINDS[kind])


def x_sds(mesh=None):
    """The input; given its layout on `mesh` (on Auto axes one without is named
    as not checked: `test_preflight_inputs.py`)."""
    sharding = None if mesh is None else NamedSharding(mesh, P("data", None))
    return jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=sharding)


@jts.jaxtyped(typechecker=beartype)
def over_model(y: Rows) -> Both:
    return y * 2  # XLA keeps `e` whole: a mismatch (on Auto axes) only XLA can see


def step(x: Rows) -> Rows:
    over_model(x)
    return x


def test_the_report_says_what_was_not_checked(kind):
    report = jts.preflight(
        step, x_sds(pod(kind)), mesh=pod(kind)
    )  # nothing it could see
    assert not report.checks.complete
    assert report.checks.compile_time >= 1 and report.checks.compiled_on is None
    (what,) = report.checks.not_checked
    assert "only XLA's partitioner decides" in what and "check_mesh=" in what
    assert "the return value of `over_model`" in what
    assert "NOT CHECKED" in str(report)


def test_check_mesh_runs_them_every_time(kind):
    check_mesh = MESHES[kind]()
    for _ in range(2):  # a second preflight traces and compiles afresh
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.preflight(step, x_sds(), mesh=pod(kind), check_mesh=check_mesh)
        text = str(info.value)
        assert "the return value of `over_model`" in text
        assert "XLA sharded it as `float32[1024@data,64]`" in text
        assert "'data': 4, 'model': 2" in text  # found on the check mesh


def test_a_concrete_mesh_is_its_own_check_mesh(kind):
    with pytest.raises(jts.ShardingTypeCheckError, match="XLA sharded it"):
        jts.preflight(step, x_sds(), mesh=MESHES[kind]())

    def fine(x: Rows) -> Rows:
        return x * 2

    mesh = MESHES[kind]()
    report = jts.preflight(fine, x_sds(mesh), mesh=mesh)
    assert report.checks.complete  # its (boundary) checks ran when compiled


def test_a_step_that_matches_is_complete_once_compiled(kind):
    @jts.jaxtyped(typechecker=beartype)
    def keeps(y: Rows) -> Rows:
        return y * 2

    def good(x: Rows) -> Rows:
        return keeps(x)

    report = jts.preflight(
        good, x_sds(pod(kind)), mesh=pod(kind), check_mesh=MESHES[kind]()
    )
    assert report.checks.complete
    assert report.checks.compiled_on == "('data': 4, 'model': 2; " + (
        "Auto axes)" if kind == "auto" else "axis types Explicit, Auto)"
    )
    assert "compile-time checks (Auto axes) compiled on" in str(report)


def test_reshard_constraints_and_arguments_are_checked_when_traced(kind):
    """What needs no partitioner is checked on the abstract mesh itself: values
    `jts.reshard` constrained, and the arguments' layouts."""
    mesh = pod(kind)

    @jts.jaxtyped(typechecker=beartype)
    def wants_rows(y: Rows) -> Rows:
        return y

    def constrained(x: Rows) -> Rows:
        return wants_rows(jts.reshard(x, Cols))

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(constrained, x_sds(), mesh=mesh)
    text = str(info.value)
    assert re.search(r"1\. \S+: argument `y` of `\S*wants_rows`", text)
    # The whole constraint on Auto axes (reshard's record); its Explicit part in
    # the type on a mixed mesh.
    shown = "1024,64@model" if kind == "auto" else "1024,64"
    assert f"`float32[{shown}]`" in text
    wrong = jax.ShapeDtypeStruct(
        (1024, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    with pytest.raises(jts.ShardingTypeCheckError, match="`x` of `\\S*step` is"):
        jts.preflight(step, wrong, mesh=mesh)


def test_unannotated_results_on_auto_axes_are_not_counted_as_known(kind):
    def step(x: Rows):  # the result's layout: XLA's choice
        return x * 2

    report = jts.preflight(step, x_sds(), mesh=pod(kind))
    (out,) = [leaf for leaf in report.leaves if leaf.group == "outputs"]
    assert out.bytes_per_device is None and "(layout ?)" in out.array
    assert report.unknown == (out,) and not report.checks.complete
    assert "at least" in report.headline()
