"""Layouts at the edges of JAX's sharding model: `reduced` axes, shardings that
are not `NamedSharding`, and memory kinds. Each verdict must be the one JAX gives
(`Sharding.is_equivalent_to`) on every path: eager, jit Explicit, jit Auto."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core import compat as _compat

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


ROWS = Float[Array, "b e", P("data")]
COLS = Float[Array, "b e", P(None, "data")]
REPLICATED = Float[Array, "b e", P()]


def _traced_verdicts(x, *annotations):
    seen = []

    def f(y):
        seen.extend(isinstance(y, a) for a in annotations)
        return y

    with no_transfers():
        jax.jit(f).trace(x)
    return seen


# -- item 16: `reduced` axes are a layout (replicated), not a pending sum


def test_reduced_axes_match_like_jax(mesh_explicit):
    # P('data', reduced={'model'}) is laid out as P('data'): replicated over model.
    x = place(mesh_explicit, (8, 4), P("data", None, reduced={"model"}))
    truth = NamedSharding(mesh_explicit, P("data")).is_equivalent_to(x.sharding, 2)
    assert truth
    with no_transfers():
        assert isinstance(x, ROWS)
        assert not isinstance(x, COLS)
    # Traced (Explicit): the same verdicts as eager and JAX.
    assert _traced_verdicts(x, ROWS, COLS, REPLICATED) == [True, False, False]


def test_reduced_made_inside_jit(mesh_explicit, checker):
    f = make_identity(checker, ROWS, ROWS)
    wrong = make_identity(checker, COLS, COLS)

    def body(a):
        b = jax.sharding.reshard(a, P("data", None, reduced={"model"}))
        assert "R:model" in str(jax.typeof(b))  # really a reduced value
        return f(b)

    x = place(mesh_explicit, (8, 4), P("data"))
    with jax.set_mesh(mesh_explicit), no_transfers():
        assert jax.jit(body)(x).shape == (8, 4)
    with jax.set_mesh(mesh_explicit), pytest.raises(CHECK_ERRORS):
        jax.jit(lambda a: wrong(jax.sharding.reshard(a, P("data", reduced={"model"}))))(
            x
        )


def test_unreduced_is_still_pending(mesh_explicit):
    # The other half of the rule: `unreduced` holds a pending sum, never a layout.
    def f(a, b):
        out = jnp.einsum(
            "ij,jk->ik", a, b, out_sharding=P(None, None, unreduced={"model"})
        )
        assert not isinstance(out, REPLICATED)
        return jax.sharding.reshard(out, P())

    a = place(mesh_explicit, (8, 4), P(None, "model"))
    b = place(mesh_explicit, (4, 4), P("model", None))
    with jax.set_mesh(mesh_explicit):
        jax.jit(f)(a, b)


# -- item 17: a GSPMDSharding under `jax.set_mesh` (an AbstractMesh in context)


def _gspmd(mesh, spec, ndim):
    # No public constructor makes a GSPMDSharding array any more; JAX itself still
    # produces them (e.g. from older serialised executables), so build one here.
    from jax._src.sharding_impls import GSPMDSharding

    named = NamedSharding(mesh, spec)
    return GSPMDSharding(tuple(mesh.devices.flat), named._to_xla_hlo_sharding(ndim))


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_gspmd_sharding_under_set_mesh(kind):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    x = jax.device_put(np.zeros((8, 4), np.float32), _gspmd(mesh, P("data"), 2))
    assert type(x.sharding).__name__ == "GSPMDSharding"
    # The same devices in another order: the same spec places other shards.
    permuted = jax.sharding.Mesh(mesh.devices[::-1], ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh), no_transfers():
        assert isinstance(x, ROWS)
        assert not isinstance(x, REPLICATED)
    with jax.set_mesh(permuted), no_transfers():
        assert not isinstance(x, ROWS)  # the verdict cache keys on the devices
    with jax.set_mesh(mesh), no_transfers():
        assert isinstance(x, ROWS)
        assert make_identity("beartype", ROWS, ROWS)(x) is x
    if _compat.legacy_mesh_context_warns():
        with pytest.warns(DeprecationWarning), mesh:
            assert isinstance(x, ROWS)
    else:
        with mesh:
            assert isinstance(x, ROWS)


# -- item 19: annotations describe the layout, not the memory space


def _memory_kind_out_of(fn, x):
    """The memory kind of `fn(x)`, or the type of the error JAX raised."""
    try:
        return fn(x).sharding.memory_kind
    except jax.errors.JaxRuntimeError as e:
        return type(e)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_memory_kind_is_not_part_of_the_annotation(kind, request):
    mesh = request.getfixturevalue(f"mesh_{kind}")
    on_host = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    x = jax.device_put(jnp.zeros((8, 4)), on_host)
    assert x.sharding.memory_kind == "pinned_host"
    with no_transfers():
        assert isinstance(x, ROWS)
        assert not isinstance(x, COLS)
    good = jts.jit(make_identity("beartype", ROWS, ROWS))
    bad = jts.jit(make_identity("beartype", COLS, COLS))
    # Through jit, the output's memory kind is whatever JAX's own jit gives: the
    # check changes nothing. JAX 0.8 itself cannot jit an array in host memory on
    # Explicit axes, and returns it in device memory on Auto axes.
    plain = _memory_kind_out_of(jax.jit(lambda v: v), x)
    with no_transfers():
        assert _memory_kind_out_of(good, x) == plain
    if _compat.JAX_VERSION >= (0, 10):
        assert plain == "pinned_host"
    error = CHECK_ERRORS if kind == "explicit" else jts.ShardingTypeCheckError
    with pytest.raises(error):
        bad(x)
    if kind == "explicit":
        assert _traced_verdicts(x, ROWS, COLS) == [True, False]


def test_only_axes_keeps_the_named_axes_of_each_dim():
    # The one helper `reshard` (axes of one type) and `typed_shard_map` (its
    # manual axes) cut a spec with.
    from jaxtyping_shard._layout.spec import only_axes

    spec = P(("data", "model"), "model", None, "data")
    assert only_axes(spec, frozenset({"data"})) == P("data", None, None, "data")
    assert only_axes(spec, frozenset({"model"})) == P("model", "model", None, None)
    assert only_axes(spec, frozenset({"data", "model"})) == spec
    assert only_axes(spec, frozenset()) == P(None, None, None, None)
