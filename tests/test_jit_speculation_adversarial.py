"""`jts.jit(in_shardings="annotations")` after warm calls must answer as a fresh
function called once does: warm it, change one thing about an argument's
placement, call again.

JAX compares a committed argument with `in_shardings` as HLO shardings, which
number devices by their place in the mesh, not by id: an array on a mesh of
the same shape over another device order, or on one device where the
annotation is replicated, passes that comparison and is moved silently. A warm
function (its speculative call, or a cached entry of the ordinary way) left that
comparison to JAX."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._drivers.jit import entry as _jit_entry

from .helpers import place


X = Float[Array, "b e", P("data", None)]
R = Float[Array, "e", P()]


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def kind(request):
    return request.param


def _meshes(kind):
    devices = np.asarray(jax.devices()[:8])
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"), axis_types=(kind,) * 2)
    other = Mesh(devices[::-1].reshape(4, 2), ("data", "model"), axis_types=(kind,) * 2)
    return mesh, other


def _jit(fun, **kwargs):
    return jts.jit(
        fun, in_shardings="annotations", out_shardings="annotations", **kwargs
    )


def scale(x: X, w: R) -> X:
    return x * w


def _want(x, w):
    return np.asarray(x) * np.asarray(w)


def _devices(out):
    return [d.id for d in out.sharding.mesh.devices.flat]


@pytest.mark.parametrize("warm", [0, 1, 3], ids=["fresh", "cached", "speculative"])
def test_another_device_order_is_refused_after_warm_calls(kind, warm):
    # Under `jax.set_mesh(mesh)`, `x` on the same axes over other devices is
    # placed otherwise: a fresh function names it, so must a warm one (once:
    # the ordinary way's cached entry; three times: speculation).
    mesh, other = _meshes(kind)
    f = _jit(scale)
    x, w = place(mesh, (8, 4), P("data")), place(mesh, (4,), P())
    wrong = place(other, (8, 4), P("data"))
    with jax.set_mesh(mesh):
        for _ in range(warm):
            f(x, w)
        # The same layout in JAX's notation: the message says which devices.
        said = (
            r"`x` is `float32\[8@data,4\]` over devices \[7, 6, 5, 4, 3, 2, 1, 0\], "
            r"its annotation asks for `float32\[8@data,4\]` .* over devices "
            r"\[0, 1, 2, 3, 4, 5, 6, 7\]"
        )
        with pytest.raises(jts.ShardingTypeCheckError, match=said):
            f(wrong, w)
        with pytest.raises(jts.ShardingTypeCheckError, match=said):
            f(wrong, w)  # and again, now that its signature was seen
        out = f(x, w)  # the right one still goes through
    np.testing.assert_allclose(np.asarray(out), _want(x, w), rtol=1e-6)


@pytest.mark.parametrize("warm", [0, 1, 3], ids=["fresh", "cached", "speculative"])
def test_one_device_for_a_replicated_annotation_after_warm_calls(kind, warm):
    # `w` committed to one device, annotated `P()` over the mesh's 8: refused
    # whether or not the function was warm.
    mesh, _ = _meshes(kind)
    f = _jit(scale)
    x, w = place(mesh, (8, 4), P("data")), place(mesh, (4,), P())
    single = jax.device_put(np.ones((4,), np.float32), jax.devices()[3])
    with jax.set_mesh(mesh):
        for _ in range(warm):
            f(x, w)
        with pytest.raises(jts.ShardingTypeCheckError, match="`w` is"):
            f(x, single)
    for _ in range(warm):  # the mesh read off the arguments instead
        f(x, w)
    with pytest.raises(jts.ShardingTypeCheckError, match="`w` is"):
        f(x, single)


@pytest.mark.parametrize("warm", [0, 1, 3], ids=["fresh", "cached", "speculative"])
def test_the_mesh_of_the_arguments_after_warm_calls(kind, warm):
    # No `jax.set_mesh`: the mesh is the arguments'. Warm on one device order,
    # then all arguments on another: the result lies on the arguments' mesh, as
    # a fresh function puts it (never the warm entry's devices).
    mesh, other = _meshes(kind)
    f = _jit(scale)
    x, w = place(mesh, (8, 4), P("data")), place(mesh, (4,), P())
    x2, w2 = place(other, (8, 4), P("data")), place(other, (4,), P())
    for _ in range(warm):
        assert _devices(f(x, w)) == _devices(place(mesh, (1,), P()))
    out = f(x2, w2)  # (not under a transfer guard: it would hide the move)
    assert out.sharding.mesh == other
    assert out.sharding.spec == P("data", None)
    np.testing.assert_allclose(np.asarray(out), _want(x2, w2), rtol=1e-6)


def test_equivalent_shardings_still_speculate_without_moving(kind):
    # `P('data')` and `P('data', None)` are the same placement: accepted after
    # warm calls with no data moved, and the steady state comes back.
    mesh, _ = _meshes(kind)
    f = _jit(scale)
    x, w = place(mesh, (8, 4), P("data")), place(mesh, (4,), P())
    same = place(mesh, (8, 4), P("data", None))
    with jax.set_mesh(mesh):
        f(x, w)
        f(x, w)
        with jax.transfer_guard_device_to_device("disallow"):
            out = f(same, w)
            f(x, w)
    np.testing.assert_allclose(np.asarray(out), _want(same, w), rtol=1e-6)


def test_reshard_inputs_moves_another_device_order_after_warm_calls(kind):
    # With `reshard_inputs=True` the array on the other device order is moved
    # to the annotation's devices, warm or not.
    mesh, other = _meshes(kind)
    f = _jit(scale, reshard_inputs=True)
    x, w = place(mesh, (8, 4), P("data")), place(mesh, (4,), P())
    wrong = place(other, (8, 4), P("data"))
    with jax.set_mesh(mesh):
        f(x, w)
        f(x, w)
        # Many times: JAX 0.10.2's own jit, having moved such an array once,
        # passes the next one unmoved to the executable and the process crashes
        # (segfault); jts.jit moves it itself each time.
        for _ in range(_jit_entry.STALE_LIMIT + 3):
            out = f(wrong, w)
            assert out.sharding.mesh == mesh
            np.testing.assert_allclose(np.asarray(out), _want(wrong, w), rtol=1e-6)


def test_leaves_inside_trees_and_donation_after_warm_calls(kind):
    # A module field and a dict entry on another device order, after warm
    # calls of a donating function: each named by its path, and the refused
    # argument not donated (the refusal comes before anything runs).
    import equinox as eqx

    class Linear(eqx.Module):
        w: Float[Array, "e m", P(None, "model")]
        b: Float[Array, "m"]  # noqa: F821

    def apply(
        m: Linear, xs: dict[str, Float[Array, "b e", P("data", None)]]
    ) -> Float[Array, "b e", P("data", None)]:
        return xs["a"] + m.w @ m.b

    mesh, other = _meshes(kind)
    f = _jit(apply, donate_argnums=1)
    m = Linear(place(mesh, (4, 2), P(None, "model")), place(mesh, (2,), P()))
    wrong = Linear(place(other, (4, 2), P(None, "model")), m.b)
    x_other = place(other, (8, 4), P("data"))
    with jax.set_mesh(mesh):
        for _ in range(3):
            f(m, {"a": place(mesh, (8, 4), P("data"))})
        xs = {"a": place(mesh, (8, 4), P("data"))}
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`m\.w` is .* over"):
            f(wrong, xs)
        assert not xs["a"].is_deleted()
        with pytest.raises(jts.ShardingTypeCheckError, match=r"`xs\['a'\]` is .* over"):
            f(m, {"a": x_other})
        assert not x_other.is_deleted()
        x = place(mesh, (8, 4), P("data"))
        want = np.asarray(x) + np.asarray(m.w) @ np.asarray(m.b)
        out = f(m, {"a": x})
    assert x.is_deleted()  # the right one donated, as before
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
