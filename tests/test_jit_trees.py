"""jaxtyping_shard.jit checks every annotated leaf of arguments and results."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._trees import walk as _tree

from .helpers import place


Row = Float[Array, "b@data e"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Float[Array, "e m@model"]
    table: dict[str, Row]


def params(mesh, w=P(None, "model"), t=P("data")):
    return Params(place(mesh, (4, 8), w), {"a": place(mesh, (8, 4), t)})


def test_arguments_by_field_and_hint(mesh_4x2):
    @jts.jit
    def f(p: Params, extra: dict[str, Row], *rest: Row, **named: Row):
        return p.w.sum()

    x = place(mesh_4x2, (8, 4), P("data"))
    f(params(mesh_4x2), {"k": x}, x, y=x)
    bad = place(mesh_4x2, (8, 4), P())
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        f(params(mesh_4x2, t=P()), {"k": bad}, x, bad, y=bad)
    text = str(info.value)
    if mesh_4x2.axis_types[0] == AxisType.Explicit:
        assert "jaxtyping_shard.jit(" in text and "arguments: 4 of 6 checked" in text
        for path in ("p.table['a']", "extra['k']", "rest[1]", "named['y']"):
            assert path in text
        assert "rest[0]" not in text
    else:  # found when XLA compiles
        assert "p.table['a']" in text or "extra['k']" in text


def test_results(mesh_4x2):
    @jts.jit
    def make(x) -> Params:
        return Params(jnp.zeros((4, 8)), {"a": x})  # w not sharded over model

    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"return\.w: |leaf `\.w` of the return value"
    ):
        with jax.set_mesh(mesh_4x2):
            make(place(mesh_4x2, (8, 4), P("data")))


def test_unannotated_functions_still_check_fields(mesh_explicit):
    @jts.jit
    def f(p):
        return p

    f(params(mesh_explicit))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"p\.w: .*e m@model"):
        f(params(mesh_explicit, w=P()))


def test_once_per_signature(mesh_explicit, monkeypatch):
    calls = []
    plan_for = _tree.plan_for
    monkeypatch.setattr(_tree, "plan_for", lambda *a: calls.append(1) or plan_for(*a))

    @jts.jit
    def f(p: Params):
        return p.w * 2

    p = params(mesh_explicit)
    f(p)
    walked = len(calls)
    assert walked > 0
    for _ in range(3):
        f(p)
    assert len(calls) == walked  # steady state: no tree walk at all
    with pytest.raises(jts.ShardingTypeCheckError):
        f(params(mesh_explicit, w=P()))  # a new signature is checked
    assert len(calls) > walked


def test_mode_off_and_warn(mesh_explicit):
    @jts.jit
    def f(p: Params):
        return p.w * 2

    bad = params(mesh_explicit, w=P())
    with jts.set_mode("off"):
        f(bad)
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
        jts.jit(lambda p: p.w * 2)(bad)
    with pytest.raises(jts.ShardingTypeCheckError):
        f(bad)


def test_inside_an_outer_jit(mesh_explicit):
    @jts.jit
    def inner(p: Params):
        return p.w * 2

    outer = jax.jit(lambda p: inner(p))
    outer(params(mesh_explicit))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"p\.w"):
        outer(params(mesh_explicit, w=P()))


def test_static_arguments_are_not_walked_into_errors(mesh_explicit):
    @jts.jit(static_argnums=1)
    def f(p: Params, n: int):
        return p.w * n

    f(params(mesh_explicit), 3)
    assert f(params(mesh_explicit), 4).shape == (4, 8)


def test_auto_mesh_reported_at_compile_time(mesh_auto):
    @jts.jit
    def f(p: Params) -> Params:
        # `* 2`: the value checked is not the constraint's own (which is decided
        # at trace time: tests/test_culprit_first.py), so XLA decides.
        w = jax.lax.with_sharding_constraint(p.w, NamedSharding(mesh_auto, P())) * 2
        return Params(w, p.table)

    p = params(mesh_auto)
    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"leaf `\.w` of the return value"
    ):
        f(p)
