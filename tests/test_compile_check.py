"""The compile-time check (Auto mesh axes): layouts XLA may choose, transformations
that meet it, one error per compile, and the JAX internals it leans on."""

import re
import warnings

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


GOOD = Float[Array, "b e", P("data", None)]
WRONG = Float[Array, "b e", P("model", None)]


def test_layout_the_mesh_cannot_write_is_a_mismatch(mesh_auto):
    # Issue 9, item 6: a tiling out of line with the mesh gave
    # `JaxRuntimeError: INTERNAL ... IndivisibleError` for any annotation.
    x = place(mesh_auto, (32,), P(("data", "model")))
    for spec in (P(), P(None, ("data", "model")), P("data", "model")):
        f = make_identity("beartype", Float[Array, "a b", spec], Float[Array, "a b"])
        with pytest.raises(jts.ShardingTypeCheckError, match="which no PartitionSpec"):
            jax.jit(lambda v, f=f: f(v.reshape(2, 16)))(x)


def test_pure_callback_result(mesh_auto):
    # Item 7: XLA gives a callback's result a maximal (one-device) sharding; it
    # crashed with `Unhandled OpSharding type`. It now gets a clean verdict, the
    # eager one for a single-device array: only an annotation that shards
    # nothing describes it.
    x = place(mesh_auto, (8, 4), P("data"))

    def call(v):
        shape = jax.ShapeDtypeStruct((8, 4), jnp.float32)
        return jax.pure_callback(lambda a: np.asarray(a) * 2, shape, v)

    plain = Float[Array, "b e"]
    replicated = make_identity("beartype", Float[Array, "b e", P()], plain)
    sharded = make_identity("beartype", GOOD, Float[Array, "b e"])
    with jax.set_mesh(mesh_auto):
        assert jax.jit(lambda v: replicated(call(v)))(x).shape == (8, 4)
        with pytest.raises(jts.ShardingTypeCheckError, match="on one device"):
            jax.jit(lambda v: sharded(call(v)))(x)


def test_check_applied_to_a_tangent(mesh_auto):
    # Item 8: an annotated helper applied to a tangent made `jax.grad` fail (no
    # transpose rule for the check).
    helper = make_identity("beartype", GOOD, GOOD)

    @jax.custom_jvp
    def h(v):
        return helper(v) * 2

    @h.defjvp
    def h_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        return h(v), helper(t) * 2

    x = place(mesh_auto, (8, 4), P("data"))
    grad = jax.jit(jax.grad(lambda v: h(v).sum()))(x)
    assert float(grad.sum()) == 64.0
    transposed = jax.jit(lambda c: jax.linear_transpose(lambda v: helper(v) * 3, x)(c))
    (ct,) = transposed(x)
    assert ct.shape == (8, 4)
    with pytest.raises(jts.ShardingTypeCheckError):
        jax.jit(jax.grad(lambda v: h(v).sum()))(place(mesh_auto, (8, 4), P("model")))


def test_no_leaked_tracers(mesh_auto):
    # Item 9: tracers kept in a module-level dict were reported as leaks.
    f = make_identity("beartype", GOOD, GOOD)
    with jax.check_tracer_leaks(True):
        assert jax.jit(lambda v: f(v) * 2)(place(mesh_auto, (8, 4), P("data"))).shape
        with pytest.raises(jts.ShardingTypeCheckError):
            jax.jit(lambda v: f(v) * 3)(place(mesh_auto, (8, 4), P("model")))


def test_export(mesh_auto):
    # Item 10: `jax.export` failed with "serialization of host_callbacks is not
    # yet implemented". It names jaxtyping_shard and the way out now.
    f = jax.jit(make_identity("beartype", GOOD, GOOD))
    x = place(mesh_auto, (8, 4), P("data"))
    way_out = "jaxtyping_shard.*set_mode\\('off'\\)"
    with pytest.raises(NotImplementedError, match=way_out):
        jax.export.export(f)(x)
    with jts.set_mode("off"):
        exported = jax.export.export(f)(x)
    assert exported.call(x).shape == (8, 4)


@pytest.mark.parametrize("placed", [P("data"), P(None, "model"), P()])
@pytest.mark.parametrize("spec", [P("data"), P("model", None), P(None, "data"), P()])
def test_empty_arrays_agree_with_eager(mesh_4x2, placed, spec, request):
    from jax.sharding import AxisType

    from jaxtyping_shard._core import compat as _compat

    if AxisType.Explicit in mesh_4x2.axis_types:
        request.applymarker(
            pytest.mark.xfail(
                not _compat.jit_handles_empty_explicit_arrays(),
                reason="JAX < 0.10's own jit fails on empty Explicit-sharded arrays",
                raises=AssertionError,
            )
        )
    # Item 18: XLA calls every array with no elements replicated; the verdict
    # through jit must be the eager one: every annotation of the rank fits.
    A = Float[Array, "b e", spec]
    x = place(mesh_4x2, (0, 4), placed)
    assert isinstance(x, A)
    f = make_identity("beartype", A, A)
    assert jax.jit(f)(x).shape == (0, 4)
    assert jax.jit(lambda v: f(v * 2))(x).shape == (0, 4)


def test_every_mismatch_of_a_compile_in_one_error(mesh_auto):
    # Issue 10, item 3: one error, in trace order, each with function, argument
    # or return value, expected, actual and the user's line.
    @jaxtyped(typechecker=beartype)
    def up(x: GOOD) -> Float[Array, "b e", P(None, "model")]:
        return x * 2

    @jaxtyped(typechecker=beartype)
    def down(y: Float[Array, "b e", P(None, "data")]) -> GOOD:
        return y + 1

    def train_step(x):
        return down(up(x))

    x = place(mesh_auto, (8, 4), P("model"))
    with no_transfers(), pytest.raises(jaxtyping.TypeCheckError) as info:
        jax.jit(train_step)(x)
    lines = str(info.value).splitlines()
    count = int(lines[0].split()[0])
    assert lines[0] == f"{count} sharding mismatches while compiling `train_step`:"
    items = lines[1 : count + 1]
    assert items[0].startswith("  1. argument `x` of `")
    assert "up` (first traced at test_compile_check.py:" in items[0]
    assert "XLA sharded it as `float32[8@model,4]`, not P('data', None)" in items[0]
    order = [("argument `x`", "up`"), ("the return value", "up`")]
    order += [("argument `y`", "down`"), ("the return value", "down`")]
    positions = []
    for what, fn in order:
        hits = [i for i, item in enumerate(items) if what in item and fn in item]
        positions.extend(hits[:1])
    assert positions == sorted(positions) and len(positions) >= 3
    assert "[jaxtyping_shard #" not in str(info.value)


def test_no_internal_marker_anywhere(mesh_auto):
    # Issue 10, item 6.
    f = make_identity("beartype", WRONG, WRONG)
    x = place(mesh_auto, (8, 4), P("data"))
    for call in (jts.jit(f), jax.jit(f)):
        with pytest.raises(jts.ShardingTypeCheckError) as info, jts.sharding_errors():
            call(x)
        assert "[jaxtyping_shard #" not in str(info.value)
        assert "INTERNAL" not in str(info.value)


def test_warn_mode_warns_in_the_calling_thread(mesh_auto):
    f = make_identity("beartype", WRONG, WRONG)
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning) as record:
        jax.jit(f)(place(mesh_auto, (8, 4), P("data")))
    assert record[0].filename == __file__


def test_internals_the_check_leans_on(mesh_auto):
    from jax._src import dispatch

    from jaxtyping_shard._verdict import (
        compiles as _compiles,
        custom_call as _custom_call,
        primitive as _primitive,
    )

    # JAX gives the lowering its devices only for primitives in this set.
    assert _primitive.check_sharding_p in dispatch.prim_requires_devices_during_lowering
    # The events our listeners wait for: the end of a compile (raised there) and
    # of a lowering (the checks' final keys: tests/test_persistent_cache.py).
    assert dispatch.BACKEND_COMPILE_EVENT == _compiles._COMPILE_EVENT
    assert dispatch.JAXPR_TO_MLIR_MODULE_EVENT == _custom_call.LOWERING_EVENT
    # DCE keeps a control-flow equation that holds a check, outputs unused.
    f = make_identity("beartype", WRONG, WRONG)
    x = place(mesh_auto, (8, 4), P("data"))

    def dead_cond(v):
        jax.lax.cond(v.sum() > 0, f, lambda u: u, v)  # result unused
        return v * 2

    def dead_while(v):
        jax.lax.while_loop(lambda c: c[1] < 1, lambda c: (f(c[0]), c[1] + 1), (v, 0))
        return v * 2

    def dead_jit(v):
        jax.jit(f)(v)
        return v * 2

    for dead in (dead_cond, dead_while, dead_jit):
        with pytest.raises(CHECK_ERRORS):
            jax.jit(dead)(x)


def test_checks_survive_clearing_jax_monitoring_listeners(mesh_auto):
    # The failures are raised by a `jax.monitoring` listener; clearing JAX's
    # listeners (public API) must not silence them.
    jax.monitoring.clear_event_listeners()
    f = make_identity("beartype", WRONG, WRONG)
    with pytest.raises(jts.ShardingTypeCheckError):
        jax.jit(lambda v: f(v) * 2)(place(mesh_auto, (8, 4), P("data")))


def _program(hlo_text: str) -> list[str]:
    """A compiled module's instructions, sorted (the schedule may order independent
    ones otherwise), without names, metadata and source tables."""
    kept, table = [], False
    for line in hlo_text.splitlines()[1:]:  # the first names the module
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = True
        elif not line.strip():
            table = False
        elif not table:
            line = re.sub(r", metadata=\{[^}]*\}", "", line)
            kept.append(re.sub(r"([%\w-]+)\.\d+\b", r"\1", line))  # numbering
    return sorted(kept)


@pytest.fixture(params=[True, False], ids=["shardy", "gspmd"])
def partitioner(request):
    # Shardy (JAX's default) or GSPMD propagates the layouts; the check's call
    # (no results, no sharding rule) meets each differently (GSPMD asks `_infer`).
    before = jax.config.jax_use_shardy_partitioner  # pyright: ignore[reportAttributeAccessIssue]
    jax.config.update("jax_use_shardy_partitioner", request.param)
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)


@pytest.mark.filterwarnings("ignore:GSPMD sharding propagation")
def test_checks_leave_the_compiled_program_as_it_was(mesh_auto, partitioner):
    # Differential: the checks (merged into one call per block, with no results
    # unused) must not sway XLA's layouts; the compiled program is the unchecked
    # one. Random placements and annotations, checks in two blocks (a scan body).
    rng = np.random.default_rng(0)
    specs = [P("data"), P("model"), P(None, "data"), P(), P(("data", "model"))]
    for _ in range(3):
        x = place(mesh_auto, (8, 4), specs[rng.integers(len(specs))])
        annotations = [Float[Array, "b e", specs[i]] for i in rng.integers(5, size=3)]

        def step(v, check, annotations=annotations):
            def body(c, _):
                check(c, annotations[0])
                return jnp.cos(c) * 2, None

            y = jnp.sin(v)
            check(y, annotations[1])
            z = jax.lax.scan(body, y @ jnp.ones((4, 4)), None, length=2)[0]
            check(z, annotations[2])
            return z.sum(0)

        def checked(v):
            return step(v, lambda a, t: isinstance(a, t))

        def unchecked(v):
            return step(v, lambda a, t: None)

        with jax.set_mesh(mesh_auto), jts.set_mode("warn"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", jts.ShardingWarning)
                lowered = jax.jit(checked).lower(x)
                assert lowered.as_text().count("@jts_check_sharding(") == 2  # blocks
                ours = lowered.compile().as_text()
                theirs = jax.jit(unchecked).lower(x).compile().as_text()
        assert "custom-call" not in ours
        assert _program(ours) == _program(theirs)
