"""Mode "warn": each warning names function and argument, points at the user's
line, and is not swallowed when different values fail with the same text."""

import warnings

import jax
import jaxtyping
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PyTree

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import fetched, make_identity, no_transfers, place


A = Float[Array, "b e", P("data", None)]


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per (text, line)
        with jts.set_mode("warn"):
            fn()
    return [w for w in caught if issubclass(w.category, jts.ShardingWarning)]


def test_names_function_and_argument_at_the_users_line(checker, mesh_explicit):
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), P("model"))
    line = None

    def call():
        nonlocal line
        line = call.__code__.co_firstlineno + 3
        f(x)

    caught = _caught(call)
    assert len(caught) == 1  # jaxtyped checks parameters twice: one warning
    message = str(caught[0].message)
    assert message.startswith(f"argument `x` of `{f.__qualname__}`: this array is")
    if checker == "beartype":
        assert caught[0].filename == __file__
        assert caught[0].lineno == line
    else:  # typeguard checks inside the instrumented function: still user code
        assert caught[0].filename.endswith("helpers.py")


def test_different_values_same_text_all_warn(mesh_explicit):
    f = make_identity("beartype", A, Float[Array, "b e"])
    xs = [place(mesh_explicit, (8, 4), P("model")) for _ in range(3)]

    def loop():
        for x in xs:
            f(x)  # the same line, the same text, three different values
        f(xs[0])  # a value already reported here: not again

    caught = _caught(loop)
    assert len(caught) == 3
    assert len({str(w.message) for w in caught}) == 1


def test_trace_time_warning_names_argument(mesh_explicit):
    f = make_identity("beartype", A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), P("model"))
    caught = _caught(lambda: jax.jit(f)(x))
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        f"argument `x` of `{f.__qualname__}`: this traced array is sharded as "
        "`float32[8@model,4]`"
    )
    assert caught[0].filename == __file__


def test_pytree_leaf_path_in_warning(mesh_explicit):
    f = make_identity("beartype", PyTree[A], PyTree[Float[Array, "b e"]])
    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    caught = _caught(lambda: f({"w": [good, bad]}))
    assert [str(w.message).split(":")[0] for w in caught] == [
        f"argument `x['w'][1]` of `{f.__qualname__}`"
    ]


def test_user_filters_still_apply(mesh_explicit):
    f = make_identity("beartype", A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), P("model"))
    with jts.set_mode("warn"), warnings.catch_warnings():
        warnings.simplefilter("error", jts.ShardingWarning)
        # raised inside the checker, which reports it as its own failure
        with pytest.raises(jaxtyping.TypeCheckError) as info:
            f(x)
    chain, error = [], info.value
    while error is not None:
        chain.append(type(error))
        error = error.__cause__ or error.__context__
    assert jts.ShardingWarning in chain
    with jts.set_mode("warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", jts.ShardingWarning)
        f(place(mesh_explicit, (8, 4), P("model")))
    assert caught == []


def test_warning_fetches_no_data(checker, mesh_explicit):
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_explicit, (8, 4), P("model"))
    with no_transfers():
        caught = _caught(lambda: f(x))
    assert len(caught) == 1
    assert fetched(x) is False
