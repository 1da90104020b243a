"""Leaves `jit` lays out as derived are decided at trace time (Auto axes).

`jts.jit(f, in_shardings="annotations", out_shardings="annotations")` gives
`jit` the very layout each sharded leaf's annotation asks for, and XLA keeps the
shardings of a program's parameters and results. The boundary checks of those
leaves are then decided at trace time, from the derived sharding, and leave no
compile-time check in the program (which would change XLA's schedule and cost
the steady-state step about 1-2%, figure 12 of benchmarks/). Every other trace
of the same function (not derived, inside another trace, another entry) still
leaves the check to the compile: tested here through JAX's caches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._verdict import compiles as _compiles, constraints as _constraints

from .helpers import mixed_mesh, place


ROWS = Float[Array, "b e", P("data", None)]
COLS = Float[Array, "b e", P(None, "model")]
LOGICAL = Float[Array, "b e", jts.Logical("batch", "embed")]


@pytest.fixture
def scheduled(monkeypatch):
    """The compile-time checks lowered into a program while in use, one per leaf
    (a trace only for its shapes, `jax.eval_shape`, lowers none)."""
    seen: list = []
    original = _compiles.Compile.register

    def counting(self, check, batch_dims):
        seen.append(check)
        return original(self, check, batch_dims)

    monkeypatch.setattr(_compiles.Compile, "register", counting)
    return seen


def step(params: dict[str, ROWS], x: COLS) -> tuple[dict[str, ROWS], COLS]:
    return {k: v * 2 for k, v in params.items()}, x + 1


def tree_args(mesh):
    params = {
        "a": place(mesh, (8, 4), P("data", None)),
        "b": place(mesh, (8, 2), P("data")),
    }
    return params, place(mesh, (8, 4), P(None, "model"))


def both():
    return jts.jit(step, in_shardings="annotations", out_shardings="annotations")


@pytest.mark.parametrize("mesh_of", ["auto", "mixed"])
def test_derived_leaves_leave_no_compile_time_check(mesh_auto, scheduled, mesh_of):
    mesh = mesh_auto if mesh_of == "auto" else mixed_mesh()
    params, x = tree_args(mesh)
    with jax.set_mesh(mesh):
        out, y = both()(params, x)
        assert scheduled == []  # 2 arguments' leaves, 2 + 1 results' leaves
        assert out["a"].sharding.spec == P("data", None)
        assert y.sharding.spec == P(None, "model")
        np.testing.assert_allclose(np.asarray(y), np.asarray(x) + 1)
        # The lowered program holds no check of them either.
        text = both().lower(params, x).as_text()
        assert "jts_check_sharding" not in text


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # `x`, annotated as one array, is its own checker's (none here).
        ({}, 5),  # nothing derived: every leaf left to the compile
        ({"in_shardings": "annotations"}, 3),  # the results' leaves
        ({"out_shardings": "annotations"}, 2),  # the arguments' leaves
    ],
)
def test_what_is_not_derived_is_still_left_to_the_compile(
    mesh_auto, scheduled, kwargs, expected
):
    params, x = tree_args(mesh_auto)
    with jax.set_mesh(mesh_auto):
        jts.jit(step, **kwargs)(params, x)
    assert len(scheduled) == expected


def test_flat_dispatch_and_numpy_arguments(mesh_auto, scheduled):
    # Uncommitted arguments are placed as derived and called through the jit of
    # the flat leaves (`Entry.flat`): decided at trace time as well.
    params, x = tree_args(mesh_auto)
    host = jax.tree.map(np.asarray, (params, x))
    f = both()
    with jax.set_mesh(mesh_auto):
        out, y = f(*host)
        out, y = f(*host)
    assert scheduled == []
    assert [e._flat is not None for e in f._cache.values()] == [True]
    assert out["b"].sharding.spec == P("data", None)
    np.testing.assert_allclose(np.asarray(out["b"]), 2 * host[0]["b"])


def test_like_leaves_too(mesh_auto, scheduled):
    def update(
        params: dict[str, ROWS], state: jts.Like["params"]
    ) -> tuple[dict[str, ROWS], jts.Like["params"]]:
        return params, jax.tree.map(lambda s: s + 1, state)

    params, _ = tree_args(mesh_auto)
    state = {"mu": params, "count": jnp.zeros((), jnp.int32)}
    f = jts.jit(update, in_shardings="annotations", out_shardings="annotations")
    with jax.set_mesh(mesh_auto):
        _, new = f(params, state)
    assert scheduled == []
    assert new["mu"]["a"].sharding.spec == P("data", None)
    assert new["count"].sharding.is_fully_replicated


def test_a_nested_trace_of_the_warm_jit_still_checks_at_compile(mesh_auto):
    # Warm the derived entry (decided at trace time), then call the same
    # `jts.jit` inside another `jit` that lays the argument out otherwise: that
    # trace knows nothing of in_shardings, and XLA's layout is checked.
    f = both()
    params, x = tree_args(mesh_auto)
    with jax.set_mesh(mesh_auto):
        f(params, x)
        wrong = NamedSharding(mesh_auto, P(None, "data"))
        outer = jax.jit(
            lambda p, x: f(p, x),
            in_shardings=({"a": wrong, "b": None}, None),
        )
        bad = dict(params, a=jax.device_put(params["a"], wrong))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"params\['a'\]"):
            outer(bad, x)
        # And the warm entry is untouched by it.
        out, _ = f(params, x)
        assert out["a"].sharding.spec == P("data", None)


def test_not_derived_after_derived_of_the_same_function(mesh_auto):
    # One function, first through a derived jit (decided at trace time), then a
    # plain `jts.jit` of it given a mis-sharded argument: caught at compile.
    params, x = tree_args(mesh_auto)
    with jax.set_mesh(mesh_auto):
        both()(params, x)
        bad = dict(params, a=place(mesh_auto, (8, 4), P(None, "data")))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"params\['a'\]"):
            jts.jit(step)(bad, x)


def test_each_rules_table_its_own_decision(mesh_auto, scheduled):
    # One logical annotation, two rules tables: two entries, each trace decided
    # with its own derived layout, and no decision taken for one serves the other.
    def double(t: dict[str, LOGICAL]) -> dict[str, LOGICAL]:
        return {k: v * 2 for k, v in t.items()}

    f = jts.jit(double, in_shardings="annotations", out_shardings="annotations")
    rows = {"x": place(mesh_auto, (8, 4), P("data", None))}
    cols = {"x": place(mesh_auto, (8, 4), P(None, "data"))}
    with jax.set_mesh(mesh_auto):
        for _ in range(2):  # warm, then through the caches
            with jts.axis_rules({"batch": "data", "embed": None}):
                assert f(rows)["x"].sharding.spec == P("data", None)
                with pytest.raises(jts.ShardingTypeCheckError, match=r"`t\['x'\]` is"):
                    f(cols)
            with jts.axis_rules({"batch": None, "embed": "data"}):
                assert f(cols)["x"].sharding.spec == P(None, "data")
                with pytest.raises(jts.ShardingTypeCheckError, match=r"`t\['x'\]` is"):
                    f(rows)
    assert scheduled == []


def test_modes_through_the_caches(mesh_auto, scheduled):
    f = both()
    params, x = tree_args(mesh_auto)
    bad = dict(params, a=place(mesh_auto, (8, 4), P(None, "data")))
    with jax.set_mesh(mesh_auto):
        f(params, x)
        with jts.set_mode("off"):
            f(params, x)
        f(params, x)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"params\['a'\]"):
            f(bad, x)  # committed otherwise: refused by path, before any trace
    assert scheduled == []


# The verdict on a placed tracer, unit by unit.


def _verdict(mesh, annotation, sharding, on_another=False):
    """The check of a traced value that `constraints.placed` says is laid out as
    `sharding` (or says it of another value)."""
    out: dict = {}

    def body(x):
        other = x + 0
        with _constraints.placed(other if on_another else x, sharding):
            out["reason"] = type(annotation).__instancecheck_str__(annotation, x)
        return x

    with jax.set_mesh(mesh):
        jax.jit(body).lower(place(mesh, (8, 4), P("data", None)))
    return out["reason"]


def test_placed_mismatch_is_named_at_trace_time(mesh_auto, scheduled):
    wrong = NamedSharding(mesh_auto, P(None, "model"))
    reason = _verdict(mesh_auto, ROWS, wrong)
    assert "float32[8,4@model]" in reason
    assert "by the shardings `jit` was given" in reason
    assert "P('data', None)" in reason
    assert scheduled == []


def test_placed_match_passes_without_a_compile_check(mesh_auto, scheduled):
    right = NamedSharding(mesh_auto, P("data", None))
    assert _verdict(mesh_auto, ROWS, right) == ""
    assert scheduled == []


def test_placed_on_another_value_decides_nothing(mesh_auto, scheduled):
    right = NamedSharding(mesh_auto, P("data", None))
    assert _verdict(mesh_auto, ROWS, right, on_another=True) == ""
    assert len(scheduled) == 1  # left to the compile


def test_placed_on_another_mesh_shape_decides_nothing(mesh_auto, scheduled):
    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    other = jax.sharding.Mesh(devices, ("data", "model"))
    assert _verdict(mesh_auto, ROWS, NamedSharding(other, P("data"))) == ""
    assert len(scheduled) == 1


# jts.filter_jit: its split function takes the arrays only; the boundary, which
# sees the whole arguments (non-array leaves included), lays the derived
# shardings on their traced leaves.


def _filter_case(mesh):
    """`(Layer, apply, a Layer laid out as annotated, an argument x)`."""
    eqx = pytest.importorskip("equinox")

    class Layer(eqx.Module):
        w: ROWS
        b: COLS
        scale: float  # a non-array leaf: static under filter_jit
        name: str = eqx.field(static=True, default="layer")

    def apply(layer: Layer, extra: tuple[COLS, int]) -> tuple[Layer, COLS]:
        x, n = extra
        new = Layer(layer.w * layer.scale, layer.b + n, layer.scale)
        return new, x * n

    layer = Layer(
        place(mesh, (8, 4), P("data", None)), place(mesh, (8, 4), P(None, "model")), 2.0
    )
    return Layer, apply, layer, place(mesh, (8, 4), P(None, "model"))


def test_filter_jit_derived_leaves_leave_no_compile_time_check(mesh_auto, scheduled):
    Layer, apply, layer, x = _filter_case(mesh_auto)
    f = jts.filter_jit(apply, in_shardings="annotations", out_shardings="annotations")
    with jax.set_mesh(mesh_auto):
        for _ in range(2):  # warm, then through the caches
            new, y = f(layer, (x, 3))
            assert new.scale == 2.0 and new.w.sharding.spec == P("data", None)
            np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 3)
        assert scheduled == []
        # Committed otherwise: refused by key path, before any trace.
        bad = Layer(place(mesh_auto, (8, 4), P(None, "data")), layer.b, 2.0)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.w"):
            f(bad, (x, 3))
        # Without the derivation the same leaves are checked when XLA compiles.
        plain = jts.filter_jit(apply)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.w"):
            plain(bad, (x, 3))
        # w, b, x in; w, b and the result's x out.
        assert len(scheduled) == 6
        assert "argument `layer.w`" in repr(scheduled[0])


def test_filter_jit_nested_in_another_jit_still_checks_at_compile(mesh_auto):
    Layer, apply, layer, x = _filter_case(mesh_auto)
    f = jts.filter_jit(apply, in_shardings="annotations", out_shardings="annotations")
    with jax.set_mesh(mesh_auto):
        f(layer, (x, 3))  # the derived entry, warm
        wrong = NamedSharding(mesh_auto, P(None, "data"))
        outer = jax.jit(lambda w, b, x: f(Layer(w, b, 2.0), (x, 3)))
        w = jax.device_put(layer.w, wrong)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.w"):
            outer(w, layer.b, x)


def test_placed_for_traced_leaves_only_is_laid_on_them(mesh_auto):
    # The boundary's walk holds static leaves the derivation did not see: the
    # shardings go to the traced leaves in order, and a count that does not
    # fit decides nothing (left to the compile).
    from jaxtyping_shard._drivers.jit import boundary as _boundary

    s = NamedSharding(mesh_auto, P("data"))
    seen = []

    def g(a, b):
        leaves = [a, 1.0, b, "static"]
        seen.append(_boundary._on_traced(leaves, (s, s)))
        seen.append(_boundary._on_traced(leaves, (s,)))
        return a

    jax.jit(g)(jnp.ones(8), jnp.ones(8))
    assert seen == [(s, None, s, None), None]
