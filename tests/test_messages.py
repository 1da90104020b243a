"""Error texts: expected, actual in JAX's notation, the mesh, and the fix."""

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import make_identity, place


def _chain(error):
    text = []
    while error is not None:
        text.append(str(error))
        error = error.__cause__
    return "\n".join(text)


def test_eager_reason(mesh_explicit):
    A = Float[Array, "b e", P("data", None)]
    x = place(mesh_explicit, (8, 4), P("model"))
    reason = A.__instancecheck_str__(x)
    assert reason.startswith(
        "this array is sharded as `float32[8@model,4]`, not P('data', None) "
        "(`b@data e`) as expected by the type hint (mesh ('data': 4, 'model': 2))."
    )
    assert "jax.device_put" in reason
    assert A.__instancecheck_str__(place(mesh_explicit, (8, 4), P("data"))) == ""


def test_tuple_of_axes_notation(mesh_explicit):
    A = Float[Array, "b e", P("data")]
    x = place(mesh_explicit, (8, 4), P(("data", "model")))
    assert "`float32[8@(data,model),4]`" in A.__instancecheck_str__(x)


def test_auto_mesh_shown_in_message(mesh_auto):
    A = Float[Array, "b e", P("model")]
    reason = A.__instancecheck_str__(place(mesh_auto, (8, 4), P("data")))
    assert "(mesh ('data': 4, 'model': 2; Auto axes))" in reason


def test_beartype_error_names_argument_and_reason(mesh_explicit):
    A = Float[Array, "batch embed", P("data", None)]
    f = make_identity("beartype", A, A)
    with pytest.raises(jaxtyping.TypeCheckError) as info:
        f(place(mesh_explicit, (8, 4), P("model")))
    message = str(info.value)
    assert "The problem arose whilst typechecking parameter 'x'" in message
    assert "P('data', None)" in message  # the expected type names the spec
    assert (
        "this array is sharded as `float32[8@model,4]`, not P('data', None) "
        "(`batch@data embed`)" in _chain(info.value)
    )


def test_trace_time_reason(mesh_explicit):
    A = Float[Array, "b e", P("data", None)]
    reasons = []

    def f(y):
        reasons.append(A.__instancecheck_str__(y))
        return y

    jax.jit(f)(place(mesh_explicit, (8, 4), P(None, "model")))
    assert reasons[0].startswith(
        "this traced array is sharded as `float32[8,4@model]`, not P('data', None) "
        "(`b@data e`)"
    )
    assert "checked at trace time" in reasons[0]


def test_compile_time_message_first_line(mesh_auto):
    A = Float[Array, "b e", P("data", None)]
    f = make_identity("beartype", A, A)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.jit(f)(place(mesh_auto, (8, 4), P("model")))
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        "argument `x` of `make_identity.<locals>.f` (first traced at "
    )
    assert (
        "XLA sharded it as `float32[8@model,4]`, not P('data', None) (`b@data e`)"
        in first
    )
    assert "checked when the function was compiled" in first


def test_single_device_message():
    A = Float[Array, "b e", P("data")]
    reason = A.__instancecheck_str__(jnp.ones((8, 4)))
    assert "lives on the single device" in reason
    assert "no mesh is set" in reason


def test_rank_message(mesh_explicit):
    A = Float[Array, "*b", P("data", "model")]
    reason = A.__instancecheck_str__(place(mesh_explicit, (8,), P("data")))
    assert "this array has 1 dimensions, fewer than the 2 sharded dims" in reason


def test_unknown_axis_message(mesh_explicit):
    A = Float[Array, "b e", P("dtaa")]
    with pytest.raises(jts.ShardingAnnotationError) as info:
        isinstance(place(mesh_explicit, (8, 4), P("data")), A)
    assert str(info.value).startswith(
        "The type hint P('dtaa') (`b@dtaa e`) names mesh axis 'dtaa', but the mesh "
        "('data': 4, 'model': 2) has axes 'data', 'model'."
    )


def test_repr_shows_spec():
    A = Float[Array, "b e", P("data", None)]
    assert "Float[" in A.__name__ and "'b e', P('data', None)]" in A.__name__
    assert A.__module__ == "jaxtyping_shard"


def test_format_spec():
    assert jts.format_spec(P("data", None)) == "P('data', None)"
    assert jts.format_spec(P(("x", "y"))) == "P(('x', 'y'),)"
    assert jts.format_spec(P()) == "P()"
