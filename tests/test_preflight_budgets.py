"""`jts.preflight`'s `max_replicated=` (MaxText's `sharding_tolerance`: a float
is a fraction of the bytes per device, an int bytes) and its inputs on Auto
axes: every one given with a layout is checked, every one without is named
(issue 36 items 2 and 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh


TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
W = Float[Array, "e m@model"]
X = Float[Array, "b@data e"]
Table = Float[Array, "v e"]  # no sharding: whole on every device
Norm = Float[Array, "e"]


@pytest.fixture(params=list(TYPES))
def kind(request):
    return request.param


def pod(kind):
    return AbstractMesh((64, 8), ("data", "model"), axis_types=(TYPES[kind],) * 2)


def step(w: W, table: Table, norm: Norm, x: X) -> X:
    return ((x * norm) @ w).sum(axis=1, keepdims=True) + table[:1]


def inputs(mesh):
    specs = {"w": P(None, "model"), "table": P(), "norm": P(), "x": P("data", None)}
    shapes = {"w": (256, 1024), "table": (512, 256), "norm": (256,), "x": (512, 256)}
    return [
        jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=NamedSharding(mesh, s))
        for k, s in specs.items()
    ]


def test_max_replicated_fails_naming_the_largest_replicated_leaves(kind):
    mesh = pod(kind)
    report = jts.preflight(step, *inputs(mesh), mesh=mesh)
    replicated = 512 * 256 * 4 + 256 * 4  # `table` and `norm`, whole everywhere
    assert report.replicated_bytes == replicated
    assert [leaf.path for leaf in report.replicated] == ["table", "norm"]
    share = replicated / report.total_bytes
    for limit in (replicated - 1, share * 0.99):  # bytes, then a fraction
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.preflight(step, *inputs(mesh), mesh=mesh, max_replicated=limit)
        text = str(info.value)
        assert "2 leaves whole on every device take 513.0 KiB per device" in text
        assert f"over max_replicated={limit!r}" in text
        lines = text.splitlines()
        first = lines.index(
            next(line for line in lines if "Largest replicated" in line)
        )
        assert lines[first + 1].strip() == "table: float32[512,256], 512.0 KiB"
        assert lines[first + 2].strip() == "norm: float32[256], 1.0 KiB"
        assert info.value.report.over_replicated
    if isinstance(limit, float):
        assert f"{limit:g} of " in text  # the fraction, and what it allows
    for limit in (replicated, min(1.0, share * 1.01)):  # at the limit: passes
        fine = jts.preflight(step, *inputs(mesh), mesh=mesh, max_replicated=limit)
        assert not fine.over_replicated


def test_max_replicated_zero_and_one_are_the_ends():
    mesh = pod("explicit")
    with pytest.raises(jts.ShardingTypeCheckError, match="max_replicated=0 "):
        jts.preflight(step, *inputs(mesh), mesh=mesh, max_replicated=0)
    jts.preflight(step, *inputs(mesh), mesh=mesh, max_replicated=1.0)


@pytest.mark.parametrize("bad", [True, -1, 1.5, "2%", -0.1])
def test_max_replicated_refuses_what_is_not_a_fraction_or_bytes(bad):
    mesh = pod("auto")
    with pytest.raises(ValueError, match="max_replicated is a fraction"):
        jts.preflight(step, *inputs(mesh), mesh=mesh, max_replicated=bad)


def test_an_input_without_a_sharding_is_named_on_auto_axes(kind):
    mesh = pod(kind)
    given = inputs(mesh)
    bare = jax.ShapeDtypeStruct(given[0].shape, given[0].dtype)  # eval_shape's kind
    report = jts.preflight(step, bare, *given[1:], mesh=mesh)
    said = [t for t in report.checks.not_checked if "without a sharding" in t]
    if kind == "auto":
        (what,) = said
        assert what.endswith(": w") and "1 input leaves" in what
        assert not report.checks.complete
        assert "NOT CHECKED: the layout of 1 input leaves" in str(report)
    else:
        assert not said  # Explicit: `jax.eval_shape` gives every leaf its layout


def test_an_eval_shape_input_built_on_auto_axes_is_named():
    """The issue's planted bug: inputs built under the wrong rules table pass
    unseen on Auto axes, where `jax.eval_shape` gives no sharding. They are
    named, by path, as not checked."""
    mesh = pod("auto")
    made = jax.eval_shape(lambda: {"w": jnp.zeros((256, 1024)), "b": jnp.zeros(8)})
    assert made["w"].sharding is None  # what makes it unseeable

    def tree_step(params: dict[str, W], x: X) -> X:
        return (x @ params["w"]).sum(axis=1, keepdims=True) * x

    report = jts.preflight(tree_step, {"w": made["w"]}, inputs(mesh)[3], mesh=mesh)
    (what,) = [t for t in report.checks.not_checked if "without a sharding" in t]
    assert what.endswith(": params['w']")


@pytest.mark.parametrize("where", ["abstract", "concrete"])
def test_a_wrong_layout_input_is_caught_on_auto_axes(where):
    """What can be checked is: a ShapeDtypeStruct's sharding, a concrete
    array's, on the AbstractMesh and on a real one (through JAX's caches: the
    step warm, then given the wrong layout)."""
    wrong_spec = P("model", None)  # `w` sharded over the wrong dim and axis
    if where == "abstract":
        mesh = pod("auto")
        given = inputs(mesh)
        given[0] = jax.ShapeDtypeStruct(
            given[0].shape, given[0].dtype, sharding=NamedSharding(mesh, wrong_spec)
        )
    else:
        mesh = make_mesh((4, 2), ("data", "model"), "auto")
        arrays = [
            jax.device_put(np.zeros(s.shape, np.float32), s.sharding)
            for s in inputs(mesh)
        ]
        jts.preflight(step, *arrays, mesh=mesh)  # right: passes, and warm
        arrays[0] = jax.device_put(arrays[0], NamedSharding(mesh, wrong_spec))
        given = arrays
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(step, *given, mesh=mesh)
    text = str(info.value)
    assert "`w` of `step`" in text and "float32[256@model,1024]" in text
