"""The sharding reason in `str(error)` of the exception users catch.

`jaxtyping_shard.jaxtyped` (beartype) and the typeguard lookup (typeguard forms),
for parameters, return values and pytree leaves; eager, under `jit` and `grad`.
"""

import dataclasses

import equinox as eqx
import jax
import jaxtyping
import pytest
import typeguard
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PyTree
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._annotation import typeguard as _typeguard

from .helpers import fetched, no_transfers, place


A = Float[Array, "b e", P("data", None)]
REASON = (
    "this array is sharded as `float32[8@model,4]`, not P('data', None) (`b@data e`) "
    "as expected by the type hint (mesh ('data': 4, 'model': 2))."
)


def make(checker, In, Out, body=lambda x: x):
    """`f(x: In) -> Out` under `jts.jaxtyped`, in the checker's documented form."""
    if checker == "beartype":

        @jts.jaxtyped(typechecker=beartype)
        def f(x: In) -> Out:
            return body(x)

    else:

        @jts.jaxtyped(typechecker=None)
        @typechecked
        def f(x: In) -> Out:
            return body(x)

    return f


ERRORS = (jaxtyping.TypeCheckError, typeguard.TypeCheckError)


def test_parameter_reason_in_str(checker, mesh_explicit):
    f = make(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with no_transfers(), pytest.raises(ERRORS) as info:
        f(x)
    message = str(info.value)
    assert REASON in message
    if checker == "beartype":
        assert isinstance(info.value, jts.ShardingTypeCheckError)
        assert message.startswith(f"argument `x` of `{f.__qualname__}`: {REASON}")
    else:
        assert message.startswith('argument "x" (jaxlib')
    good = place(mesh_explicit, (8, 4), P("data"))
    assert f(good) is good  # and the passing call after the failing one


def test_return_reason_in_str(checker, mesh_explicit):
    f = make(checker, Float[Array, "b e"], A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with pytest.raises(ERRORS) as info:
        f(x)
    message = str(info.value)
    assert REASON in message
    if checker == "beartype":
        assert message.startswith(f"the return value of `{f.__qualname__}`: {REASON}")
    else:
        assert message.startswith("the return value (jaxlib")


def test_trace_time_and_grad(mesh_explicit):
    f = make("beartype", A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.jit(f)(x)
    assert "this traced array is sharded as `float32[8@model,4]`" in str(info.value)
    assert "checked at trace time" in str(info.value)
    # Under grad with no jit nothing is staged: the message must not say so.
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.grad(lambda y: f(y).sum())(x)
    first = str(info.value).splitlines()[0]
    assert "this array, differentiated by `grad`/`jvp`/`vjp` outside `jit`," in first
    assert "traced" not in first and "trace time" not in first
    # and inside jit, grad's values are traced
    with pytest.raises(jts.ShardingTypeCheckError, match="checked at trace time"):
        jax.jit(jax.grad(lambda y: f(y).sum()))(x)


def test_pytree_leaf_named_by_key_path(mesh_explicit):
    @jts.jaxtyped(typechecker=beartype)
    def step(params: PyTree[A]) -> None:
        return None

    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    params = {"layers": [{"w_in": good}, {"w_in": bad}]}
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        step(params)
    assert str(info.value).startswith(
        f"argument `params['layers'][1]['w_in']` of `{step.__qualname__}`: {REASON}"
    )


class Mlp(eqx.Module):
    w_in: jax.Array


class Block(eqx.Module):
    mlp: Mlp


class Model(eqx.Module):
    blocks: list


def test_module_leaf_named_by_attribute_path(mesh_explicit):
    @jts.jaxtyped(typechecker=beartype)
    def forward(model: PyTree[A]) -> None:
        return None

    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    model = Model([Block(Mlp(good)), Block(Mlp(bad))])
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        forward(model)
    assert str(info.value).startswith(
        f"argument `model.blocks[1].mlp.w_in` of `{forward.__qualname__}`: {REASON}"
    )
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.blocks\[1\]"):
        jax.jit(forward)(model)


def test_shape_failure_is_jaxtypings_own(mesh_explicit):
    f = make("beartype", A, A)
    with pytest.raises(jaxtyping.TypeCheckError) as info:
        f(place(mesh_explicit, (8,), P("data")))
    assert not isinstance(info.value, jts.ShardingTypeCheckError)
    assert str(info.value).startswith("Type-check error whilst checking the parameters")


def test_second_argument_named(mesh_explicit):
    @jts.jaxtyped(typechecker=beartype)
    def add(x: A, y: A) -> A:
        return x

    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        add(good, bad)
    assert str(info.value).startswith(f"argument `y` of `{add.__qualname__}`: ")


def test_nested_calls_report_their_own_failure(mesh_explicit):
    inner = make("beartype", A, A)

    @jts.jaxtyped(typechecker=beartype)
    def outer(x: Float[Array, "b e"]) -> Float[Array, "b e"]:
        return inner(x)

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        outer(place(mesh_explicit, (8, 4), P("model")))
    assert str(info.value).startswith(f"argument `x` of `{inner.__qualname__}`: ")
    assert str(info.value).count(REASON) == 1


def test_same_signature_and_forms(mesh_explicit):
    x = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))

    @jts.jaxtyped(typechecker=beartype)
    @dataclasses.dataclass
    class Holder:
        x: A

    assert Holder(x).x is x
    with pytest.raises(jts.ShardingTypeCheckError, match="argument `x` of "):
        Holder(bad)

    class Layer:
        @jts.jaxtyped(typechecker=beartype)
        def apply(self, x: A) -> A:
            return x

        @staticmethod
        @jts.jaxtyped(typechecker=beartype)
        def static(x: A) -> A:
            return x

    assert Layer().apply(x) is x and Layer.static(x) is x
    with pytest.raises(jts.ShardingTypeCheckError, match=r"`x` of `.*Layer\.apply`"):
        Layer().apply(bad)
    with pytest.raises(jts.ShardingTypeCheckError):
        Layer.static(bad)
    with jts.jaxtyped("context"):
        assert isinstance(x, A)


def test_typeguard_lookup_registered():
    assert _typeguard.lookup in typeguard.checker_lookup_functions
    assert _typeguard.lookup(A, (), ()) is not None
    assert _typeguard.lookup(Float[Array, "b e"], (), ()) is None
    assert _typeguard.lookup(int, (), ()) is None


def test_pytree_leaf_path_at_compile_time(mesh_auto):
    @jts.jaxtyped(typechecker=beartype)
    def step(params: PyTree[A]) -> None:
        return None

    good = place(mesh_auto, (8, 4), P("data"))
    bad = place(mesh_auto, (8, 4), P("model"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.jit(step)({"layers": [{"w_in": good}, {"w_in": bad}]})
    assert str(info.value).startswith(
        "1 sharding mismatch while compiling `step`: "
        f"argument `params['layers'][1]['w_in']` of `{step.__qualname__}` (first "
        "traced at test_jaxtyped.py:"
    )


def test_vmap_without_jit_is_not_called_traced(mesh_explicit):
    B = Float[Array, "e", P("model")]
    f = make("beartype", B, B)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.vmap(f)(place(mesh_explicit, (8, 4), P(None, "data")))
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        f"argument `x` of `{f.__qualname__}`: this array, batched by `vmap` outside "
        "`jit`, is sharded as `float32[4@data]`, not P('model') (`e@model`)"
    )
    assert "trace" not in first


def test_typeguard_failure_reads_no_array_data(mesh_explicit):
    f = make("typeguard", A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with no_transfers(), pytest.raises(typeguard.TypeCheckError):
        f(x)
    assert not fetched(x)


def test_beartype_failure_reads_the_value_as_documented(mesh_explicit):
    # beartype's own message holds `repr(x)`, which copies the values to the host;
    # beartype has no option against it (docs/getting-started.md says so). Our
    # part of the message holds none of them.
    f = make("beartype", A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        f(x)
    assert fetched(x)
    assert "Array(" not in str(info.value)
    assert "Array(" in str(info.value.__cause__.__cause__)


def test_argument_returned_unchanged_is_named_by_its_annotation(mesh_explicit):
    B = Float[Array, "b e", P(None, "model")]

    @jts.jaxtyped(typechecker=beartype)
    def passthrough(x: Float[Array, "b e"]) -> B:
        return x

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        passthrough(place(mesh_explicit, (8, 4), P("data")))
    assert str(info.value).startswith(
        f"the return value of `{passthrough.__qualname__}`"
    )


Tree = PyTree[A]


def test_typeguard_pytree_leaf_reason_under_jts_jaxtyped(mesh_explicit):
    @jts.jaxtyped(typechecker=None)
    @typechecked
    def step(params: Tree) -> Tree:
        return params

    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    with pytest.raises(typeguard.TypeCheckError) as info:
        step({"w": [good, bad]})
    assert str(info.value).startswith(
        f"argument `params['w'][1]` of `{step.__qualname__}`: {REASON}"
    )
    assert 'argument "params" (dict) is not an instance of' in str(info.value)


def test_auto_mesh_under_grad_without_jit(mesh_auto):
    # The compile-time check runs eagerly here and raises inside the checker;
    # jaxtyping wraps it, and jts.jaxtyped brings its text up front.
    f = make("beartype", A, A)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.grad(lambda y: f(y).sum())(place(mesh_auto, (8, 4), P("model")))
    assert str(info.value).startswith(f"argument `x` of `{f.__qualname__}` (first")
    assert "XLA sharded it as `float32[8@model,4]`" in str(info.value)
