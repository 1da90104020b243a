"""A check moves no data, ever (issue 22, item 4).

`jts.jit(in_shardings="annotations")`'s `.eval_shape`, `.trace` and `.lower`
work from abstract values (a `jax.ShapeDtypeStruct` with the derived sharding)
and move nothing, also with `reshard_inputs=True`; a `jax.ShapeDtypeStruct`
whose sharding contradicts its annotation is named by path, as the call names a
committed array. `typed_shard_map` refuses, by path, a committed argument that
shard_map would move. `place` / `place_for` check the local data against the
whole annotation (dtype, fixed dims, dim names) before building anything. Each
"nothing moved" is asserted twice: under `jax.transfer_guard("disallow_explicit")`
(explicit transfers included) and by making `jax.device_put` fail; on Explicit,
Auto and mixed meshes, with warm caches.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Bool, Float, Float32, Int, Int32, Shaped, UInt8

from .helpers import MESHES, place


X = Float[Array, "b e", P("data", None)]


@pytest.fixture(scope="module", params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Float[Array, "e m", P(None, "model")]


@jaxtyped(typechecker=beartype)
def step(params: Params, x: X) -> X:
    return x * params.w.sum()


@contextlib.contextmanager
def nothing_moves(monkeypatch):
    """Explicit transfers disallowed, and `jax.device_put` refused outright."""

    def refuse(*args, **kwargs):
        raise AssertionError("jax.device_put was called")

    with monkeypatch.context() as patch, jax.transfer_guard("disallow_explicit"):
        patch.setattr(jax, "device_put", refuse)
        yield


def _derived(mesh):
    return (
        NamedSharding(mesh, P(None, "model")),
        NamedSharding(mesh, P("data", None)),
    )


@pytest.mark.parametrize("warm", [False, True])
def test_abstract_methods_move_nothing(mesh, monkeypatch, warm):
    w_sharding, x_sharding = _derived(mesh)
    params = Params(np.ones((4, 2), np.float32))
    rows = np.ones((8, 4), np.float32)
    f = jts.jit(step, in_shardings="annotations", out_shardings="annotations")
    uncommitted = jnp.asarray(rows)  # made outside `set_mesh`: not committed
    with jax.set_mesh(mesh):
        if warm:  # the call's own entry (it places, as jit would), then again
            f(params, rows)
        with nothing_moves(monkeypatch):
            shapes = f.eval_shape(params, rows)
            traced = f.trace(params, uncommitted)
            lowered = f.lower(params, rows)
        compiled = lowered.compile()
        (w_in, x_in), _ = compiled.input_shardings
        out = f(params, rows)  # the call still places after an abstract entry
    assert shapes.sharding.is_equivalent_to(x_sharding, 2)
    assert traced.jaxpr is not None
    assert w_in.w.is_equivalent_to(w_sharding, 2) and x_in.is_equivalent_to(
        x_sharding, 2
    )
    assert compiled.output_shardings.is_equivalent_to(x_sharding, 2)
    assert out.sharding.is_equivalent_to(x_sharding, 2)


def test_reshard_inputs_abstractly(mesh, monkeypatch):
    _, x_sharding = _derived(mesh)
    params = Params(place(mesh, (4, 2), P(None, "model")))
    wrong = place(mesh, (8, 4), P("model"))
    f = jts.jit(step, in_shardings="annotations", reshard_inputs=True)
    with jax.set_mesh(mesh):
        with nothing_moves(monkeypatch):
            shapes = f.eval_shape(params, wrong)
            lowered = f.lower(params, wrong)
        assert lowered.compile().input_shardings[0][1].is_equivalent_to(x_sharding, 2)
        moved = f(params, wrong)  # the call moves it, as asked
    assert shapes.shape == (8, 4)
    assert moved.sharding.is_equivalent_to(x_sharding, 2)


def test_a_contradicting_shape_dtype_struct_is_named(mesh, monkeypatch):
    params = Params(place(mesh, (4, 2), P(None, "model")))
    wrong = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P()))
    wrong_w = jax.ShapeDtypeStruct(
        (4, 2), jnp.float32, sharding=NamedSharding(mesh, P("model"))
    )
    f = jts.jit(step, in_shardings="annotations")
    with jax.set_mesh(mesh):
        f.eval_shape(params, jax.ShapeDtypeStruct((8, 4), jnp.float32))  # warm
        for method in (f.trace, f.eval_shape, f.lower):
            with nothing_moves(monkeypatch):
                with pytest.raises(jts.ShardingTypeCheckError) as info:
                    method(Params(wrong_w), wrong)
            text = str(info.value)
            assert "2 arguments" in text, text
            assert "`params.w` is `float32[4@model,2]`" in text, text
            assert "`x` is `float32[8,4]`" in text, text
        right = jax.ShapeDtypeStruct(
            (8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data"))
        )
        assert f.lower(params, right).compile() is not None
        g = jts.jit(step, in_shardings="annotations", reshard_inputs=True)
        out = g.eval_shape(params, wrong)  # on Explicit axes, with a sharding
        if out.sharding is not None:
            spec = out.sharding.spec
            assert NamedSharding(mesh, spec).is_equivalent_to(_derived(mesh)[1], 2)


def test_typed_shard_map_refuses_what_it_would_move(mesh, monkeypatch):
    @jts.typed_shard_map(mesh=mesh)
    def scaled(params: Params, x: X) -> X:
        return x * jax.lax.psum(params.w.sum(), "model")

    params = Params(place(mesh, (4, 2), P(None, "model")))
    x = place(mesh, (8, 4), P("data"))
    expected = np.asarray(scaled(params, x))  # placed as annotated: runs
    reverse = jax.sharding.Mesh(
        np.asarray(jax.devices())[::-1].reshape(4, 2),
        ("data", "model"),
        axis_types=mesh.axis_types,
    )
    cases = [
        (
            Params(params.w),
            place(mesh, (8, 4), P("model")),
            r"`x` is `float32\[8@model",
        ),
        (Params(place(mesh, (4, 2), P())), x, r"`params.w` is `float32\[4,2\]`"),
        (params, place(reverse, (8, 4), P("data")), r"`x` .* over devices \[7, 6"),
    ]
    for p, value, said in cases:
        with (
            nothing_moves(monkeypatch),
            pytest.raises(jts.ShardingTypeCheckError, match=said),
        ):
            scaled(p, value)
    # Under jit the arguments are traced: laid out by the trace, not refused.
    np.testing.assert_allclose(np.asarray(jax.jit(scaled)(params, x)), expected)


def test_place_checks_the_whole_annotation_first(mesh, monkeypatch):
    built = []
    make = jax.make_array_from_process_local_data

    def counted(*args, **kwargs):
        built.append(args[0])
        return make(*args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_process_local_data", counted)
    cases = [
        (np.ones((8, 4), np.float32), Int[Array, "b e", P("data")], "dtype float32"),
        (np.ones((8, 9), np.int32), Int[Array, "b 8", P("data")], "size 9"),
        (np.ones((8, 4), np.int32), Int[Array, "n n", P("data")], "dimension n"),
        (np.ones((8, 4), np.bool_), Int[Array, "b e", P("data")], "dtype bool"),
    ]
    for data, annotation, said in cases:
        with pytest.raises(jts.PlacementError, match=said):
            jts.place(data, annotation, mesh)

    def consumer(tokens: Int[Array, "b 8", P("data")]):
        return tokens

    with pytest.raises(
        jts.PlacementError, match=r"(?s)consumer, 'tokens'\): .* size 9"
    ):
        jts.place_for(consumer, "tokens", np.ones((8, 9), np.int32), mesh)
    # Every misfit of a tree in one error, nothing built.
    with pytest.raises(jts.PlacementError) as info:
        jts.place(
            {"a": np.ones((8, 4), np.float32), "b": np.ones((8, 9), np.int32)},
            {"a": Int[Array, "b e", P("data")], "b": Int[Array, "b 8", P("data")]},
            mesh,
        )
    assert "2 of 2" in str(info.value) and "local['a']" in str(info.value)
    assert not built
    ok = jts.place(np.ones((8, 8), np.int32), Int[Array, "n n", P("data")], mesh)
    assert built and isinstance(ok, Int[Array, "n n", P("data")])


DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int8, np.uint8, np.bool_]
KINDS = [Float, Float32, Int, Int32, UInt8, Bool, Shaped]
DIMS = ["b e", "b 8", "n n", "b _", "b *rest", "8 e"]


def test_place_never_builds_what_fails_its_annotation(slow):
    @settings(max_examples=600 if slow else 60, deadline=None, derandomize=not slow)
    @given(
        dtype=st.sampled_from(DTYPES),
        kind=st.sampled_from(KINDS),
        dims=st.sampled_from(DIMS),
        shape=st.tuples(st.sampled_from([4, 8, 16]), st.sampled_from([4, 8, 9])),
    )
    def run(dtype, kind, dims, shape):
        # Differential: `place` either refuses before building, or gives an array
        # its own annotation accepts; never the other two outcomes.
        mesh = MESHES["explicit"]()
        annotation = kind[Array, dims, P("data")]
        try:
            placed = jts.place(np.zeros(shape, dtype), annotation, mesh)
        except jts.PlacementError:
            placed = None
        if placed is not None:
            assert isinstance(placed, annotation), (dtype, dims, shape)
        else:
            # Refused: the same data, placed by hand, fails the annotation or its
            # sizes do not fit the mesh.
            x = np.zeros(shape, jax.dtypes.canonicalize_dtype(dtype))
            assert shape[0] % 4 or not isinstance(
                jax.device_put(x, NamedSharding(mesh, P("data"))), annotation
            )

    run()
