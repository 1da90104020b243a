"""`jts.preflight`: a step checked on a 4,096-device mesh, with no devices."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, fetched, make_identity, no_transfers, place


def pod(kind=AxisType.Explicit, shape=(512, 8)):
    return AbstractMesh(shape, ("data", "model"), axis_types=(kind,) * 2)


def sds(shape, sharding=None, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


Rows = Float[Array, "b@data e"]
Cols = Float[Array, "b e@model"]
Whole = Float[Array, "m", P()]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Float[Array, "e@data m@model"]
    scale: Whole
    step: jax.Array  # no annotation: counted, not checked


def params_sds(mesh=None):
    at = (lambda spec: NamedSharding(mesh, spec)) if mesh is not None else None
    return Params(
        sds((4096, 1024), at and at(P("data", "model"))),
        sds((4096,), at and at(P())),
        sds((), at and at(P()), jnp.int32),
    )


def two_mismatches(checker):
    """A step whose two helpers each get a value laid out otherwise."""
    wants_cols = make_identity(checker, Cols, Cols)
    wants_rows = make_identity(checker, Rows, Rows)

    def step(p: Params, x: Rows) -> Rows:
        wants_cols(x)  # line A: x is over data, not model
        y = jax.sharding.reshard(x, P(None, "model"))
        wants_rows(y)  # line B: y is over model
        return x

    return step


def test_every_mismatch_in_one_error_by_path_and_line(checker):
    step = two_mismatches(checker)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(step, params_sds(), sds((1024, 64)), mesh=pod())
    text = str(info.value)
    assert (
        "preflight of `two_mismatches.<locals>.step` on mesh ('data': 512, 'model': 8)"
        in text
    )
    assert "2 sharding mismatches" in text
    first, second = text.index("\n  1. "), text.index("\n  2. ")
    assert first < text.index("float32[1024@data,64]") < second  # trace order
    assert "float32[1024,64@model]" in text[second:]
    # Each with its line: the caller's (beartype), or the checked function's own
    # (typeguard checks inside its body).
    assert len(re.findall(r"\n  \d\. \w+\.py:\d+: argument `x` of", text)) == 2
    if checker == "beartype":
        assert text.count("test_preflight.py:") == 2
    assert "If the array is right" in text and text.count("If the array") == 1


def test_a_step_that_matches_passes_and_is_counted():
    def step(p: Params, x: Rows) -> Rows:
        return x * p.scale.sum()

    report = jts.preflight(step, params_sds(), sds((1024, 64)), mesh=pod())
    assert isinstance(report, jts.PreflightReport)
    by_path = {leaf.path: leaf for leaf in report.leaves}
    w = by_path["p.w"]
    assert w.spec == P("data", "model") and w.shard_shape == (8, 128)
    assert w.bytes_per_device == 8 * 128 * 4
    assert by_path["p.scale"].replicated
    assert by_path["p.scale"].bytes_per_device == 4096 * 4
    assert by_path["x"].bytes_per_device == 2 * 64 * 4
    assert by_path["outputs"].bytes_per_device == 2 * 64 * 4
    assert report.argument_bytes == 8 * 128 * 4 + 4096 * 4 + 4 + 2 * 64 * 4
    assert report.output_bytes == 2 * 64 * 4
    assert report.total_bytes == report.argument_bytes + report.output_bytes
    assert report.by_argument() == {
        "p": 8 * 128 * 4 + 4096 * 4 + 4,
        "x": 512,
        "outputs": 512,
    }
    assert list(report.by_top_level()) == ["p.w", "p.scale", "p.step", "x", "outputs"]
    assert report.largest(1)[0].path == "p.scale"
    assert [r.path for r in report.replicated] == ["p.scale", "p.step"]
    # Nothing was left unchecked but the leaf with no annotation, which is named.
    assert report.checks.complete and report.checks.unannotated == ("p.step",)
    assert report.checks.leaves_checked == 4
    data = report.as_dict()
    assert data["total_bytes"] == report.total_bytes and len(data["leaves"]) == 5
    text = str(report)
    for part in ("largest leaves", "replicated (whole on every device)", "p.scale"):
        assert part in text
    assert "NOT CHECKED" not in text and "not checked): 1 leaves: p.step" in text
    assert "float32[4096@data,1024@model]" in report.leaves_table()


def test_a_cached_trace_never_hides_a_mismatch(checker):
    step = two_mismatches(checker)
    args = (params_sds(), sds((1024, 64)))
    mesh = pod()
    # The same trace warmed in mode "warn" (no check fails it, so JAX caches it).
    placed = (params_sds(mesh), sds((1024, 64), NamedSharding(mesh, P("data"))))
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
        with jax.sharding.use_abstract_mesh(mesh):
            jax.jit(step).trace(*placed)
    for _ in range(2):  # and preflight's own trace of the last call
        with pytest.raises(jts.ShardingTypeCheckError, match="2 sharding mismatches"):
            jts.preflight(step, *args, mesh=mesh)
    with jts.set_mode("off"):  # preflight checks whatever the mode says
        with pytest.raises(jts.ShardingTypeCheckError, match="2 sharding mismatches"):
            jts.preflight(step, *args, mesh=mesh)
        assert jts.get_mode() == "off"
    # Preflight leaves no mode or cached trace behind: a checked trace still fails.
    assert jts.get_mode() == "check"
    with pytest.raises(CHECK_ERRORS, match="b e@model"):
        with jax.sharding.use_abstract_mesh(mesh):
            jax.jit(step).trace(*placed)


def test_arguments_laid_out_otherwise_are_listed_with_the_rest():
    mesh = pod()
    step = two_mismatches("beartype")
    wrong = Params(
        sds((4096, 1024), NamedSharding(mesh, P("model", "data"))),
        sds((4096,), NamedSharding(mesh, P("data"))),
        sds((), None, jnp.int32),
    )
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(step, wrong, sds((1024, 64)), mesh=mesh)
    text = str(info.value)
    assert "4 sharding mismatches" in text
    step_name = "`two_mismatches.<locals>.step`"
    assert f"argument `p.w` of {step_name} is `float32[4096@model,1024@data]`" in text
    assert f"argument `p.scale` of {step_name} is `float32[4096@data]`" in text
    assert text.index("p.w") < text.index("p.scale") < text.index("\n  3. ")


def test_concrete_arguments_count_as_their_layout_and_are_never_read(mesh_4x2):
    step = two_mismatches("beartype")

    def fine(p: Params, x: Rows) -> Rows:
        return x

    concrete = Params(
        place(mesh_4x2, (4096, 1024), P("data", "model")),
        place(mesh_4x2, (4096,), P()),
        jnp.zeros((), jnp.int32),  # uncommitted: placed as annotated
    )
    x = np.ones((1024, 64), np.float32)  # NumPy: placed as annotated
    before = jax.live_arrays()  # held: no new array can take one's id
    with no_transfers():
        report = jts.preflight(fine, concrete, x, mesh=pod())
        with pytest.raises(jts.ShardingTypeCheckError, match="2 sharding mism"):
            jts.preflight(step, concrete, x, mesh=pod())
    known = {id(a) for a in before}
    assert [a for a in jax.live_arrays() if id(a) not in known] == []  # none made
    assert not fetched(concrete.w) and not fetched(concrete.scale)
    assert report.leaves[0].spec == P("data", "model")
    assert report.leaves[0].bytes_per_device == 8 * 128 * 4
    # A concrete array laid out otherwise keeps its layout, and is listed.
    swapped = dataclasses.replace(concrete, w=place(mesh_4x2, (4096, 1024), P()))
    with pytest.raises(
        jts.ShardingTypeCheckError,
        match=r"`p.w` of `\S*fine` is `float32\[4096,1024\]`",
    ):
        jts.preflight(fine, swapped, x, mesh=pod())


def test_budget_names_the_largest_leaves():
    def step(p: Params, x: Rows) -> Rows:
        return x

    report = jts.preflight(step, params_sds(), sds((1024, 64)), mesh=pod())
    total = report.total_bytes
    ok = jts.preflight(step, params_sds(), sds((1024, 64)), mesh=pod(), hbm_bytes=total)
    assert not ok.over_budget and "within the budget" in str(ok)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(
            step, params_sds(), sds((1024, 64)), mesh=pod(), hbm_bytes=total - 1
        )
    text = str(info.value)
    assert "is over the budget hbm_bytes=" in text and f"({total - 1} bytes)" in text
    assert text.index("p.scale: float32[4096]") < text.index("p.w:")  # largest first
    assert info.value.report.total_bytes == total  # type: ignore[attr-defined]
    # Mismatches and the budget: one error for both.
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(
            two_mismatches("beartype"),
            params_sds(),
            sds((1024, 64)),
            mesh=pod(),
            hbm_bytes=1,
        )
    assert "2 sharding mismatches" in str(info.value)
    assert "over the budget" in str(info.value)


def test_indivisible_dims_are_listed_before_anything_is_traced():
    def step(p: Params, x: Rows) -> Rows:
        raise AssertionError("not traced")

    bad = Params(sds((4000, 1024)), sds((4096,)), sds((), None, jnp.int32))
    with pytest.raises(jts.ShardingAnnotationError) as info:
        jts.preflight(step, bad, sds((1000, 64)), mesh=pod())
    text = str(info.value)
    assert "2 of its arguments cannot be laid out as annotated" in text
    assert "p.w: `float32[4000@data,1024@model]`: dim 0 (4000)" in text
    assert "x: `float32[1000@data,64]`" in text and "Pad it to (1024, 64)" in text


def test_indivisible_arguments_of_a_real_call_are_named(mesh_4x2):

    def f(x: Rows, y: Rows) -> Rows:
        return x

    step = jts.jit(f, in_shardings="annotations")
    with pytest.raises(jts.ShardingAnnotationError, match=r"x: .*\n  y: "):
        with jax.set_mesh(mesh_4x2):
            step(np.ones((10, 4), np.float32), np.ones((6, 4), np.float32))


def test_what_a_step_is(mesh_4x2):
    """A function, `jax.jit` and `jts.jit` of it are preflighted alike; arguments
    with no arrays are static."""

    def step(p: Params, x: Rows, n: int) -> Rows:
        return x * n

    forms = [
        step,
        jax.jit(step, static_argnums=2),
        jts.jit(step, static_argnums=2),
        jts.jit(step, in_shardings="annotations", static_argnums=2),
        jts.jit(step, out_shardings="annotations", static_argnums=2),
    ]
    for form in forms:
        report = jts.preflight(form, params_sds(), sds((1024, 64)), 3, mesh=pod())
        assert report.name == "test_what_a_step_is.<locals>.step"
        assert report.by_argument() == {"p": 20484, "x": 512, "outputs": 512}


def test_not_inside_a_trace():
    def step(x: Rows) -> Rows:
        return x

    @jax.jit
    def outer(x):
        return jts.preflight(step, x, mesh=pod())

    with pytest.raises(ValueError, match="outside jit"):
        outer(jnp.ones((1024, 4)))


def test_a_mismatch_jax_then_refuses_is_still_named_first():
    Scale = Float[Array, "e"]

    @jts.jaxtyped(typechecker=__import__("beartype").beartype)
    def norm(x: Rows, s: Whole) -> Rows:
        return x * s  # JAX refuses [b@data, e] * [e@data]

    def step(x: Rows, s: Scale) -> Rows:
        return norm(x, jax.sharding.reshard(s, P("data")))

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(step, sds((1024, 512)), sds((512,)), mesh=pod())
    text = str(info.value)
    assert re.search(r"\n  1\. test_preflight.py:\d+: argument `s` of `\S*norm`", text)
    assert "The trace then stopped:" in text
    assert isinstance(info.value.__cause__, Exception)


def test_mesh_arguments_are_checked(mesh_explicit):
    with pytest.raises(ValueError, match="needs a"):
        jts.preflight(lambda x: x, sds((4,)), mesh="pod")
    with pytest.raises(ValueError, match="axis names and types"):
        jts.preflight(
            lambda x: x, sds((4,)), mesh=pod(AxisType.Auto), check_mesh=mesh_explicit
        )
    with pytest.raises(ValueError, match="concrete"):
        jts.preflight(lambda x: x, sds((4,)), mesh=pod(), check_mesh=pod())
    for budget in (0, -1, 1.5, "16GiB"):
        with pytest.raises(ValueError, match="hbm_bytes is a number of bytes"):
            jts.preflight(lambda x: x, sds((4,)), mesh=pod(), hbm_bytes=budget)
    # The arrays' mesh axes must be the mesh's.
    other = AbstractMesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with pytest.raises(jts.ShardingAnnotationError, match="lacks"):
        jts.preflight(lambda x: x, sds((8,), NamedSharding(other, P("x"))), mesh=pod())


Hidden = Float[Array, "b@data h@model"]


def test_checks_inside_shard_map_run_at_4096_devices(checker):
    """A body's local shards are checked as global arrays there too."""
    mesh = pod()
    whole = make_identity(checker, Rows, Rows)  # `h` whole: it varies over model

    def step(x: Rows, w: Float[Array, "e h@model"]) -> Hidden:
        @jts.typed_shard_map(mesh=mesh)
        def column(x: Rows, w: Float[Array, "e h@model"]) -> Hidden:
            h = x @ w
            whole(h)
            return h

        return column(x, w)

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(step, sds((1024, 64)), sds((64, 512)), mesh=mesh)
    text = str(info.value)
    assert "1 sharding mismatch" in text and "inside shard_map" in text
    assert "varies over 'model'" in text
