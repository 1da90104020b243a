"""Inside shard_map: which dim a manual axis splits, and the order of the axes in
a tuple entry, are checked for the body's arguments against the `in_specs`
(eager and jit, Explicit and Auto meshes); other values keep the checks that need
no `in_specs` (global shape, varying axes)."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, typed_shard_map
from jaxtyping_shard._verdict.manual import in_spec_of

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


ROWS = Float[Array, "a b", P("data", None)]
COLS = Float[Array, "a b", P(None, "data")]
DM = Float[Array, "n", P(("data", "model"))]
MD = Float[Array, "n", P(("model", "data"))]


def _mesh(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)


def _call(how, mapped, *args):
    with no_transfers():
        return mapped(*args) if how == "eager" else jax.jit(mapped)(*args)


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_dim_and_order_of_arguments(kind, how):
    mesh = _mesh(kind)
    seen = []

    def body(x, y):
        seen.append([isinstance(x, ROWS), isinstance(x, COLS)])
        seen.append([isinstance(y, DM), isinstance(y, MD)])
        return x

    x = place(mesh, (8, 8), P("data", None))  # square: the local shape cannot tell
    y = place(mesh, (8,), P(("model", "data")))
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), P(("model", "data"))), out_specs=P("data")
    )
    _call(how, mapped, x, y)
    assert seen == [[True, False], [False, True]]


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_checked_body_rejects_a_transposed_in_spec(kind, how, checker):
    mesh = _mesh(kind)
    x = place(mesh, (8, 8), P(None, "data"))
    wrong = make_identity(checker, ROWS, Float[Array, "..."])
    right = make_identity(checker, COLS, Float[Array, "..."])
    specs = dict(mesh=mesh, in_specs=P(None, "data"), out_specs=P(None, "data"))
    assert _call(how, jax.shard_map(right, **specs), x).shape == (8, 8)
    with pytest.raises(CHECK_ERRORS):
        _call(how, jax.shard_map(wrong, **specs), x)
    with jts.set_mode("off"):
        assert _call(how, jax.shard_map(wrong, **specs), x).shape == (8, 8)
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning, match="in_specs"):
        _call(how, jax.shard_map(wrong, **specs), x)


def test_message_names_the_in_specs(mesh_explicit):
    reasons = []

    def body(x):
        reasons.append(ROWS.__instancecheck_str__(x))
        return x

    x = place(mesh_explicit, (8, 8), P(None, "data"))
    jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_explicit,
            in_specs=P(None, "data"),
            out_specs=P(None, "data"),
        )
    )(x)
    (reason,) = reasons
    assert "in_specs=P(None, 'data')" in reason
    assert "P('data', None)" in reason


def test_partial_manual_axes(mesh_explicit):
    # Manual over 'data' only: in_specs name 'data'; 'model' stays Explicit and is
    # read from the value's type.
    seen = []
    both = Float[Array, "a b", P("data", "model")]
    swapped = Float[Array, "a b", P("model", "data")]

    def body(x):
        seen.append((isinstance(x, both), isinstance(x, swapped)))
        return x

    x = place(mesh_explicit, (8, 8), P("data", "model"))
    jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_explicit,
            in_specs=P("data"),
            out_specs=P("data"),
            axis_names={"data"},
        )
    )(x)
    assert seen == [(True, False)]


def test_intermediates_have_no_in_spec(mesh_explicit):
    # Only the body's arguments have a known split; a value computed from them
    # (or passed through a nested jit) is checked without the in_specs.
    found = []

    def body(x):
        found.append(in_spec_of(x))
        found.append(in_spec_of(x * 2))
        jax.jit(lambda v: found.append(in_spec_of(v)) or v)(x)
        return x

    x = place(mesh_explicit, (8, 8), P("data"))
    jax.jit(
        jax.shard_map(body, mesh=mesh_explicit, in_specs=P("data"), out_specs=P("data"))
    )(x)
    assert found == [P("data"), None, None]


def test_typed_shard_map_agrees_with_its_specs(checker):
    # typed_shard_map derives in_specs from the same annotations: always agrees.
    mesh = _mesh("auto")

    @typed_shard_map(mesh=mesh)
    def f(x: COLS, y: MD) -> COLS:
        assert isinstance(x, COLS) and not isinstance(x, ROWS)
        assert isinstance(y, MD) and not isinstance(y, DM)
        return x

    x = place(mesh, (8, 8), P(None, "data"))
    y = place(mesh, (8,), P(("model", "data")))
    assert jax.jit(f)(x, y).shape == (8, 8)
    assert f(x, y).shape == (8, 8)
