"""Through JAX's caches: a trace, lowering or executable made in one mode (or in a
discarded trace) never stands in for a check in another.

Each test warms a cache, changes something, and calls again. `kind` runs it on an
Explicit mesh (checked while tracing) and on an Auto mesh (checked while XLA
compiles).
"""

import jax
import jaxtyping
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS, Compiles, make_identity, place


A = Float[Array, "b e", P("data", None)]
# What a failure raises, on either mesh: Explicit ones are jaxtyping's (or
# typeguard's) errors at trace time; Auto ones are `ShardingTypeCheckError`, a
# `jaxtyping.TypeCheckError`, through `jts.jit` / `sharding_errors`.
FAILURES = CHECK_ERRORS


@pytest.fixture(params=["explicit", "auto"])
def kind(request):
    return request.param


def _mesh(kind):
    return make_mesh((4, 2), ("data", "model"), kind)


def _values(kind):
    mesh = _mesh(kind)
    return mesh, place(mesh, (8, 4), P("data")), place(mesh, (8, 4), P("model"))


def test_warn_then_check_checks_again(kind, checker):
    # Issue 9, item 1: jts.jit replayed the warn-mode trace (Explicit) or
    # executable (Auto) after going back to "check".
    _, good, bad = _values(kind)
    f = jts.jit(make_identity(checker, A, A))
    assert f(good).shape == (8, 4)
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
        assert f(bad).shape == (8, 4)
    with pytest.raises(FAILURES):
        f(bad)
    assert f(good).shape == (8, 4)


def test_lower_and_trace_in_mode_off(kind):
    # Item 2: `.lower(x)` / `.trace(x)` inside mode "off" cached a trace without
    # checks that later calls in mode "check" reused.
    _, _, bad = _values(kind)
    for stage in ("lower", "trace"):
        f = jts.jit(make_identity("beartype", A, A))
        with jts.set_mode("off"):
            getattr(f, stage)(bad)
        with pytest.raises(FAILURES):
            f(bad)


def test_inside_outer_jit_in_mode_off(kind):
    # Item 3: a jts.jit function called inside another jit in mode "off" was never
    # checked again, called directly or through a new outer jit.
    _, _, bad = _values(kind)
    inner = jts.jit(make_identity("beartype", A, A))
    with jts.set_mode("off"):
        assert jax.jit(lambda v: inner(v) * 2)(bad).shape == (8, 4)
    with pytest.raises(FAILURES):
        inner(bad)
    with pytest.raises(FAILURES), jts.sharding_errors():
        jax.jit(lambda v: inner(v) * 2)(bad)


def test_plain_jax_jit_sees_mode_changes(kind):
    # Item 21: plain jax.jit replayed a trace made in mode "off" (Explicit too).
    _, good, bad = _values(kind)
    f = jax.jit(make_identity("beartype", A, A))
    with jts.set_mode("off"):
        assert f(bad).shape == (8, 4)
    with pytest.raises(FAILURES), jts.sharding_errors():
        f(bad)
    assert f(good).shape == (8, 4)


def test_bare_set_mode_changes_the_cache_key(kind):
    _, _, bad = _values(kind)
    f = jax.jit(make_identity("beartype", A, A))
    jts.set_mode("off")
    assert f(bad).shape == (8, 4)
    jts.set_mode("check")
    with pytest.raises(FAILURES), jts.sharding_errors():
        f(bad)


@pytest.mark.parametrize("discard", ["eval_shape", "make_jaxpr"])
def test_discarded_traces_do_not_swallow_the_real_check(kind, discard):
    # Item 12: de-duplication by tracer id dropped the check of the real compile
    # when a discarded trace (eval_shape, make_jaxpr) had checked the same tracer
    # first.
    _, good, bad = _values(kind)
    f = make_identity("beartype", A, A)

    def g(v):
        if discard == "eval_shape":
            jax.eval_shape(lambda: f(v))
        else:
            jax.make_jaxpr(lambda: f(v))()
        return f(v) * 2

    assert jts.jit(g)(good).shape == (8, 4)
    with pytest.raises(FAILURES):
        jts.jit(g)(bad)


def test_cond_on_a_constant_flag_checks_both_calls(kind):
    # Item 12: both branches call the annotated function on the same (outer)
    # value; XLA drops the branch JAX traced first, so its check must not stand
    # in for the other's.
    _, good, bad = _values(kind)
    f = make_identity("beartype", A, A)

    def g(v):
        return jax.lax.cond(True, lambda: f(v) * 2, lambda: f(v) * 3)

    assert jts.jit(g)(good).shape == (8, 4)
    with pytest.raises(FAILURES):
        jts.jit(g)(bad)


def test_compiles_once_per_signature(kind):
    # Item 22: one trace and one compile per signature, Explicit and Auto.
    _, good, _ = _values(kind)
    traces = []
    checked = make_identity("beartype", A, A)

    def f(v):
        traces.append(1)
        return checked(v) * 2

    g = jts.jit(f)
    for _ in range(3):
        g(good)
    assert len(traces) == 1
    assert g._cache_size() == 1


def test_mode_read_by_the_check_is_the_keyed_one(mesh_auto):
    # The mode a compile-time check applies is the one its trace was keyed on,
    # not the one in force when XLA happens to compile it.
    bad = place(mesh_auto, (8, 4), P("model"))
    f = jax.jit(make_identity("beartype", A, A))
    with jts.set_mode("warn"):
        lowered = f.lower(bad)
    with pytest.warns(jts.ShardingWarning):
        lowered.compile()
    with pytest.raises(jaxtyping.TypeCheckError), jts.sharding_errors():
        f.lower(bad).compile()


def test_fast_reader_reads_the_same_state():
    # `_config._fast_reader` reads JAX's state through a private attribute.
    from jaxtyping_shard._core import modes as _config

    assert _config._fast_reader(_config.MODE._context) is not None
    with jts.set_mode("warn"):
        assert _config.MODE._reader.value == "warn" == _config.MODE._context.value
    assert _config.MODE._reader.value == "check" == _config.MODE._context.value


@pytest.mark.parametrize("first", ["call", "lower"])
def test_a_call_and_lower_on_abstract_values_share_one_compile(kind, first):
    # Issue 33, item 5: `lower` on `jax.ShapeDtypeStruct`s (as `jts.collectives`
    # and the baselines use it) derived the same shardings as a call with the
    # arrays, but made its own `jit`, so the step was traced and compiled again.
    mesh, good, _ = _values(kind)
    traces = []

    @jts.jit(in_shardings="annotations", out_shardings="annotations")
    def step(v: A) -> A:
        traces.append(1)
        return v * 2

    shapes = jax.ShapeDtypeStruct(good.shape, good.dtype, sharding=good.sharding)
    with jax.set_mesh(mesh), Compiles() as compiles:
        if first == "call":
            step(good)
            step.lower(shapes).compile()
            report = jts.collectives(step, shapes)
        else:
            step.lower(shapes).compile()
            step(good)
            report = jts.collectives(step, shapes)
    assert len(traces) == 1 and compiles.count == 1
    assert report.count == 0  # a step laid out as annotated moves nothing
