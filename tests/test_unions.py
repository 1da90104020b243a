"""Unions of sharded annotations: a value matching ANY member passes, in every mode,
on every path (eager, jit Explicit, jit Auto), also as `PyTree[Union[...]]`; a
member naming axes the mesh lacks simply does not match."""

import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped, PyTree

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


ROWS = Float[Array, "b e", P("data")]
COLS = Float[Array, "b e", P(None, "model")]
EITHER = Union[ROWS, COLS]
FAIL = CHECK_ERRORS + (jts.ShardingTypeCheckError,)


def _run(kind, f, *args):
    """Calls `f` eagerly, or through `jts.jit` (Explicit: trace-time check; Auto:
    compile-time check)."""
    with no_transfers():
        if kind == "eager":
            return f(*args)
        return jts.jit(f)(*args)


def _mesh_for(kind, request):
    return request.getfixturevalue("mesh_auto" if kind == "auto" else "mesh_explicit")


# -- item 14: a member for another mesh does not match; isinstance never raises


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_member_for_another_mesh(axis_type, checker):
    mesh_a = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    mesh_b = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    ON_A = Float[Array, "n", P("data")]
    ON_B = Float[Array, "n", P("x")]
    f = make_identity(checker, Union[ON_A, ON_B], Union[ON_A, ON_B])
    xa = place(mesh_a, (8,), P("data"))
    xb = place(mesh_b, (8,), P("x"))
    xb_wrong = place(mesh_b, (8,), P("y"))
    with no_transfers():
        assert isinstance(xb, ON_B)
        assert not isinstance(xb, ON_A)  # returns False: no ShardingAnnotationError
        assert not isinstance(xa, ON_B)
        assert "names mesh axis 'data'" in ON_A.__instancecheck_str__(xb)
    for kind in ("eager", "jit"):
        assert _run(kind, f, xa) is not None
        assert _run(kind, f, xb) is not None
        with pytest.raises(FAIL):
            _run(kind, f, xb_wrong)


def test_member_for_another_mesh_traced(mesh_explicit):
    ON_OTHER = Float[Array, "b e", P("x")]
    seen = []

    def f(y):
        seen.append(isinstance(y, ON_OTHER))
        seen.append(isinstance(y, (ON_OTHER, ROWS)))  # as beartype checks a Union
        return y

    jax.jit(f).trace(place(mesh_explicit, (8, 4), P("data")))
    assert seen == [False, True]


# -- item 15: any member passes, in every mode, also under Auto


@pytest.mark.parametrize("kind", ["eager", "explicit", "auto"])
def test_any_member_passes(kind, checker, request):
    mesh = _mesh_for(kind, request)
    f = make_identity(checker, EITHER, EITHER)
    rows = place(mesh, (8, 4), P("data"))
    cols = place(mesh, (8, 4), P(None, "model"))
    neither = place(mesh, (8, 4), P("model"))
    for mode in ("check", "warn", "off"):
        with jts.set_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning about a non-matching member
            assert _run(kind, f, rows).shape == (8, 4)
            assert _run(kind, f, cols).shape == (8, 4)
    with pytest.raises(FAIL) as info:
        _run(kind, f, neither)
    if kind == "auto":
        assert "any member of the Union" in str(info.value)
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
        _run(kind, f, neither)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_union_inside_jit_then_return_hint(kind, request):
    # The union holds for the parameter only: a return annotated with one member
    # is still checked against that member alone.
    mesh = _mesh_for(kind, request)
    cols = place(mesh, (8, 4), P(None, "model"))
    to_cols = make_identity("beartype", EITHER, COLS)
    to_rows = make_identity("beartype", EITHER, ROWS)
    assert _run(kind, to_cols, cols).shape == (8, 4)
    with pytest.raises(FAIL):
        _run(kind, to_rows, cols)


def test_isinstance_in_the_body_is_not_the_union(mesh_auto):
    # A plain isinstance in the body asks for that member alone, even if the same
    # class is a member of the parameter's union.
    @jaxtyped(typechecker=beartype)
    def f(x: EITHER) -> Float[Array, "b e"]:
        assert isinstance(x, ROWS)
        return x

    cols = place(mesh_auto, (8, 4), P(None, "model"))
    with pytest.raises(jts.ShardingTypeCheckError):
        _run("auto", f, cols)


@pytest.mark.parametrize("kind", ["eager", "explicit", "auto"])
def test_optional_and_unsharded_members(kind, checker, request):
    mesh = _mesh_for(kind, request)
    opt = make_identity(checker, Optional[ROWS], Optional[ROWS])
    loose = make_identity(
        checker, Union[ROWS, Float[Array, "b e"]], Union[ROWS, Float[Array, "b e"]]
    )
    cols = place(mesh, (8, 4), P(None, "model"))
    assert _run(kind, loose, cols).shape == (8, 4)  # the unsharded member holds
    with pytest.raises(FAIL):
        _run(kind, opt, cols)


W = Float[Array, "d f", P("data", None)]
B = Float[Array, "f", P()]


@pytest.mark.parametrize("kind", ["eager", "explicit", "auto"])
def test_pytree_of_union(kind, request):
    # jaxtyping's structure pass offers every leaf to every member, shapes
    # unchecked; the weight's check must not land on the bias.
    mesh = _mesh_for(kind, request)

    @jaxtyped(typechecker=beartype)
    def f(params: PyTree[Union[W, B]]) -> PyTree[Union[W, B]]:
        return params

    def tree(w_spec):
        return {
            "w": place(mesh, (8, 4), w_spec),
            "b": place(mesh, (4,), P()),
            "layers": [
                {"w": place(mesh, (8, 4), P("data")), "b": place(mesh, (4,), P())}
            ],
        }

    good, bad = tree(P("data")), tree(P("model"))
    for mode in ("check", "warn"):
        with jts.set_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _run(kind, f, good)["w"].shape == (8, 4)
    with pytest.raises(FAIL):
        _run(kind, f, bad)


def test_union_across_a_cache(mesh_auto):
    # The same jitted function, called with a value for each member, then with one
    # for neither: each compile decides on its own.
    f = jts.jit(make_identity("beartype", EITHER, EITHER))
    for spec in (P("data"), P(None, "model"), P("data")):
        assert f(place(mesh_auto, (8, 4), spec)).shape == (8, 4)
    with pytest.raises(jts.ShardingTypeCheckError):
        f(place(mesh_auto, (8, 4), P("model")))
    g = jax.jit(make_identity("beartype", EITHER, EITHER))
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh_auto, P(None, "model")))
    with jts.sharding_errors():
        assert g(x).shape == (8, 4)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_union_under_jts_jaxtyped(kind, request):
    mesh = _mesh_for(kind, request)

    @jts.jaxtyped(typechecker=beartype)
    def f(x: EITHER) -> EITHER:
        return x

    assert _run(kind, f, place(mesh, (8, 4), P(None, "model"))).shape == (8, 4)
    with pytest.raises(jts.ShardingTypeCheckError):
        _run(kind, f, place(mesh, (8, 4), P("model")))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_union_with_logical_members(kind, request):
    mesh = _mesh_for(kind, request)
    LW = Float[Array, "embed mlp", jts.Logical]
    LB = Float[Array, "mlp", jts.Logical]

    @jaxtyped(typechecker=beartype)
    def f(x: Union[LW, ROWS], tree: PyTree[Union[LW, LB]]) -> Union[LW, ROWS]:
        return x

    tree = {
        "w": place(mesh, (8, 4), P("data", "model")),
        "b": place(mesh, (4,), P("model")),
    }
    with jts.axis_rules({"embed": "data", "mlp": "model"}):
        for spec in (P("data", "model"), P("data")):  # the logical one, then ROWS
            assert _run(kind, f, place(mesh, (8, 4), spec), tree).shape == (8, 4)
        with pytest.raises(FAIL):
            _run(kind, f, place(mesh, (8, 4), P("model")), tree)
