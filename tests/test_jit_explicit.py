"""Inside `jit` with Explicit mesh axes: checked at trace time from `jax.typeof`."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_binary, make_identity, no_transfers, place
from .test_eager import MATCHES, MISMATCHES


@pytest.mark.parametrize("placed, spec", MATCHES)
def test_match(checker, mesh_explicit, placed, spec):
    A = Float[Array, "b e", spec]
    f = jax.jit(make_identity(checker, A, A))
    x = place(mesh_explicit, (8, 4), placed)
    with no_transfers():
        out = f(x)
    assert out.shape == (8, 4)


@pytest.mark.parametrize("placed, spec", MISMATCHES)
def test_mismatch_at_trace_time(checker, mesh_explicit, placed, spec):
    A = Float[Array, "b e", spec]
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), placed)
    with no_transfers(), pytest.raises(CHECK_ERRORS):
        jax.jit(f).trace(x)  # tracing alone finds it: no compile, no run


def test_isinstance_on_tracer(mesh_explicit):
    seen = []

    def f(x):
        seen.append(isinstance(x, Float[Array, "b e", P("data", None)]))
        seen.append(isinstance(x, Float[Array, "b e", P("model", None)]))
        return x

    jax.jit(f)(place(mesh_explicit, (8, 4), P("data")))
    assert seen == [True, False]


def test_return_value(checker, mesh_explicit):
    body = lambda x, y: jax.sharding.reshard(
        x + y, jax.NamedSharding(mesh_explicit, P(None, "model"))
    )
    A = Float[Array, "b e", P("data", None)]
    good = make_binary(checker, A, A, Float[Array, "b e", P(None, "model")], body)
    bad = make_binary(checker, A, A, Float[Array, "b e", P("data", None)], body)
    x = place(mesh_explicit, (8, 4), P("data"))
    with no_transfers():
        assert jax.jit(good)(x, x).sharding.spec == P(None, "model")
        with pytest.raises(CHECK_ERRORS):
            jax.jit(bad)(x, x)


def test_intermediate_sharding_follows_jax(checker, mesh_explicit):
    # x @ w with x P("data", None) and w P(None, "model") is P("data", "model").
    A = Float[Array, "b e", P("data", None)]
    W = Float[Array, "e m", P(None, "model")]
    out_ok = Float[Array, "b m", P("data", "model")]
    out_bad = Float[Array, "b m", P("data", None)]
    x = place(mesh_explicit, (8, 4), P("data"))
    w = place(mesh_explicit, (4, 6), P(None, "model"))
    with no_transfers():
        assert jax.jit(make_binary(checker, A, W, out_ok, lambda a, b: a @ b))(
            x, w
        ).shape == (8, 6)
        with pytest.raises(CHECK_ERRORS):
            jax.jit(make_binary(checker, A, W, out_bad, lambda a, b: a @ b))(x, w)


def test_size_one_axis_in_jit(checker):
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    A = Float[Array, "b e", P("data", "model")]
    x = place(mesh, (8, 4), P("data"))
    assert jax.jit(make_identity(checker, A, A))(x).shape == (8, 4)


def test_context_mesh_for_tracers(mesh_explicit):
    x = place(mesh_explicit, (8, 4), P())

    def f(y):
        assert isinstance(y, Float[Array, "b e", P()])
        assert not isinstance(y, Float[Array, "b e", P("data")])
        assert not isinstance(y, Float[Array, "b e", P("fsdp")])  # no such axis
        return y

    with jax.set_mesh(mesh_explicit):
        jax.jit(f)(x)


def test_no_mesh_at_all():
    import jax.numpy as jnp

    def f(y):
        assert isinstance(y, Float[Array, "b e", P()])
        assert not isinstance(y, Float[Array, "b e", P("data")])
        return y

    jax.jit(f)(jnp.ones((8, 4)))


def test_no_custom_call_left_in_compiled_hlo(mesh_explicit):
    A = Float[Array, "b e", P("data", None)]
    f = make_identity("beartype", A, A)
    x = place(mesh_explicit, (8, 4), P("data"))
    hlo = jax.jit(lambda v: f(v) * 2).lower(x).compile().as_text()
    assert "custom-call(" not in hlo
