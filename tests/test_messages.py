"""Error texts: expected, actual in JAX's notation, the mesh, and the fix."""

import inspect

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
import typeguard
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped, PyTree
from typeguard import typechecked

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
    lines = str(info.value).splitlines()
    assert lines[0] == "2 sharding mismatches while compiling `f`:"
    assert lines[1].startswith(
        "  1. argument `x` of `make_identity.<locals>.f` (first traced at "
    )
    assert (
        "XLA sharded it as `float32[8@model,4]`, not P('data', None) (`b@data e`)"
        in lines[1]
    )
    assert lines[2].startswith("  2. the return value of `make_identity.<locals>.f`")
    assert "[jaxtyping_shard #" not in str(info.value)


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
    x = place(mesh_explicit, (8, 4), P("data"))
    assert not isinstance(x, A)  # no match, not an error: see test_unions.py
    assert A.__instancecheck_str__(x).startswith(
        "the type hint P('dtaa') (`b@dtaa e`) names mesh axis 'dtaa', but the mesh "
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


# Full texts, pinned as jaxtyping's own test_messages does. `ARRAY` is how
# jaxtyping names `jax.Array` (its module moves between jax versions).
ARRAY = jaxtyping.Float[Array, "x"].__name__.removeprefix("Float[")[: -len(", 'x']")]
FIX = (
    "If the array is right and the annotation wrong, change the annotation; "
    "otherwise place the array with `jax.device_put(x, NamedSharding(mesh, spec))` "
    "or, inside `jit`, `jax.sharding.reshard` / `jax.lax.with_sharding_constraint`."
)
HINT = f"jaxtyping_shard.Float[{ARRAY}, 'batch embed', P('data', None)]"
Batch = Float[Array, "batch embed", P("data", None)]


@jts.jaxtyped(typechecker=beartype)
def scale(x: Batch) -> Batch:
    return x


@jts.jaxtyped(typechecker=beartype)
def unplace(x: Float[Array, "batch embed"]) -> Batch:
    return x


@jts.jaxtyped(typechecker=beartype)
def step(params: PyTree[Batch]) -> None:
    return None


def test_full_text_parameter(mesh_explicit):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        scale(place(mesh_explicit, (8, 4), P("model")))
    assert str(info.value) == (
        "argument `x` of `scale`: this array is sharded as `float32[8@model,4]`, not "
        "P('data', None) (`batch@data embed`) as expected by the type hint (mesh "
        f"('data': 4, 'model': 2)). {FIX}\n"
        "Type-check error whilst checking the parameters of "
        "tests.test_messages.scale.\n"
        "The problem arose whilst typechecking parameter 'x'.\n"
        "Actual value: f32[8,4]\n"
        f"Expected type: <class '{HINT}'>.\n"
        "----------------------\n"
        "Called with parameters: {'x': f32[8,4]}\n"
        f"Parameter annotations: (x: {HINT}) -> Any.\n"
        "The current values for each jaxtyping axis annotation are as follows.\n"
        "batch=8\n"
        "embed=4"
    )


def test_full_text_return(mesh_explicit):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        unplace(place(mesh_explicit, (8, 4), P(None, "model")))
    assert str(info.value) == (
        "the return value of `unplace`: this array is sharded as "
        "`float32[8,4@model]`, not P('data', None) (`batch@data embed`) as expected "
        f"by the type hint (mesh ('data': 4, 'model': 2)). {FIX}\n"
        "Type-check error whilst checking the return value of "
        "tests.test_messages.unplace.\n"
        "Actual value: f32[8,4]\n"
        f"Expected type: {HINT}.\n"
        "----------------------\n"
        "Called with parameters: {'x': f32[8,4]}\n"
        f"Parameter annotations: (x: Float[{ARRAY}, 'batch embed']) -> Any.\n"
        "The current values for each jaxtyping axis annotation are as follows.\n"
        "batch=8\n"
        "embed=4"
    )


def test_full_text_pytree_leaf(mesh_explicit):
    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P())
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        step({"layers": [{"w_in": good}, {"w_in": bad}]})
    assert str(info.value) == (
        "argument `params['layers'][1]['w_in']` of `step`: this array is sharded as "
        "`float32[8,4]`, not P('data', None) (`batch@data embed`) as expected by the "
        f"type hint (mesh ('data': 4, 'model': 2)). {FIX}\n"
        "Type-check error whilst checking the parameters of tests.test_messages.step.\n"
        "The problem arose whilst typechecking parameter 'params'.\n"
        "Actual value: {'layers': [{'w_in': f32[8,4]}, {'w_in': f32[8,4]}]}\n"
        f"Expected type: <class 'PyTree[{HINT}]'>.\n"
        "----------------------\n"
        "Called with parameters: {'params': {'layers': [{'w_in': f32[8,4]}, "
        "{'w_in': f32[8,4]}]}}\n"
        f"Parameter annotations: (params: PyTree[{HINT}]) -> Any.\n"
        "The current values for each jaxtyping axis annotation are as follows.\n"
        "batch=8\n"
        "embed=4"
    )


def test_full_text_typeguard(mesh_explicit):
    @jaxtyped(typechecker=None)
    @typechecked
    def add(x: Batch) -> Batch:
        return x

    with pytest.raises(typeguard.TypeCheckError) as info:
        add(place(mesh_explicit, (8, 4), P("model")))
    assert str(info.value) == (
        f'argument "x" ({type(place(mesh_explicit, (8,), P())).__module__}.ArrayImpl) '
        f"is not an instance of {HINT}, as this array is sharded as "
        "`float32[8@model,4]`, not P('data', None) (`batch@data embed`) as expected "
        f"by the type hint (mesh ('data': 4, 'model': 2)). {FIX}"
    )


def test_full_text_warn_mode(mesh_explicit):
    x = place(mesh_explicit, (8, 4), P("model"))
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning) as caught:
        scale(x)
    assert [str(w.message) for w in caught] == [
        "argument `x` of `scale`: this array is sharded as `float32[8@model,4]`, not "
        "P('data', None) (`batch@data embed`) as expected by the type hint (mesh "
        f"('data': 4, 'model': 2)). {FIX}",
    ]  # `x`, returned as is, fails the same annotation again: warned once
    assert caught[0].filename == __file__


@jts.jaxtyped(typechecker=beartype)
def add(x: Batch, y: Batch) -> Batch:
    return x + y


def test_full_text_auto_mismatches(mesh_auto):
    x = place(mesh_auto, (8, 4), P("model"))
    y = place(mesh_auto, (8, 4), P(None, "model"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        line = inspect.currentframe().f_lineno + 1
        jts.jit(add)(x, y)
    where = f"(first traced at test_messages.py:{line})"
    expected = (
        "not P('data', None) (`batch@data embed`) as expected by the type hint "
        f"Float[{ARRAY}, 'batch embed', P('data', None)] (mesh ('data': 4, 'model': "
        "2; Auto axes))."
    )
    assert str(info.value) == (
        "3 sharding mismatches while compiling `add`:\n"
        f"  1. argument `x` of `add` {where}: XLA sharded it as `float32[8@model,4]`, "
        f"{expected}\n"
        f"  2. argument `y` of `add` {where}: XLA sharded it as `float32[8,4@model]`, "
        f"{expected}\n"
        f"  3. the return value of `add` {where}: XLA sharded it as "
        f"`float32[8@model,4]`, {expected}\n"
        f"{FIX}"
    )
