"""`jts.jit(f, in_shardings="annotations", out_shardings="annotations")`."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import place


X = Float[Array, "b e", P("data", None)]
W = Float[Array, "e m", P(None, "model")]
Y = Float[Array, "b m", P("data", "model")]
Bias = Float[Array, "m"]  # no sharding: unspecified, JAX chooses


def _mesh(kind, shape=(4, 2)):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * 2)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return _mesh(request.param)


@jaxtyped(typechecker=beartype)
def layer(x: X, w: W) -> Y:
    return x @ w


def _derived(fun=layer, **kwargs):
    return jts.jit(
        fun, in_shardings="annotations", out_shardings="annotations", **kwargs
    )


def test_inputs_and_outputs_take_the_annotated_shardings(mesh):
    f = _derived()
    x, w = np.ones((8, 4), np.float32), np.ones((4, 2), np.float32)
    with jax.set_mesh(mesh):
        y = f(x, w)
        compiled = f.lower(x, w).compile()
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 2)
    np.testing.assert_array_equal(np.asarray(y), np.full((8, 2), 4.0))
    ins, _ = compiled.input_shardings
    assert ins[0].is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    assert ins[1].is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert compiled.output_shardings.spec == P("data", "model")


def test_committed_mismatch_names_the_argument(mesh):
    f = _derived()
    wrong = place(mesh, (8, 4), P("model", None))
    w = place(mesh, (4, 2), P(None, "model"))
    for call in (f, f.lower, f.trace):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            call(wrong, w)
        text = str(info.value)
        assert "layer: 1 argument is committed" in text
        assert "`x` is `float32[8@model,4]`" in text
        assert "asks for `float32[8@data,4]`" in text
        assert "reshard_inputs=True" in text
        assert "Sharding passed to jit" not in text
    right = place(mesh, (8, 4), P("data", None))
    assert f(right, w).sharding.spec == P("data", "model")  # mesh from the args


def test_reshard_inputs_moves_committed_arguments(mesh):
    f = _derived(reshard_inputs=True)
    wrong = place(mesh, (8, 4), P("model", None))
    w = place(mesh, (4, 2), P(None, "model"))
    y = f(wrong, w)
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(wrong) @ np.asarray(w))
    assert wrong.sharding.spec == P("model", None)  # the caller's array untouched


def test_warm_cache_then_a_mismatch_still_names_the_argument(mesh):
    # After a call with every leaf committed as annotated, later calls leave the
    # comparison to JAX's dispatch; a mismatch must still be named, not JAX's
    # "Sharding passed to jit", and reshard_inputs must still move it.
    right = place(mesh, (8, 4), P("data", None))
    wrong = place(mesh, (8, 4), P("model", None))
    w = place(mesh, (4, 2), P(None, "model"))
    f, moving = _derived(), _derived(reshard_inputs=True)
    for _ in range(2):
        assert f(right, w).sharding.spec == P("data", "model")
        assert moving(right, w).sharding.spec == P("data", "model")
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        f(wrong, w)
    assert "`x` is `float32[8@model,4]`" in str(info.value)
    assert "Sharding passed to jit" not in str(info.value)
    y = moving(wrong, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(wrong) @ np.asarray(w))
    # An equivalent spelling of the annotated sharding passes, warm or not.
    same = place(mesh, (8, 4), P("data"))
    assert f(same, w).sharding.spec == P("data", "model")
    # Uncommitted arrays of the same shapes are placed as annotated.
    assert f(np.ones((8, 4), np.float32), w).sharding.spec == P("data", "model")
    assert f(right, w).sharding.spec == P("data", "model")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "e m", P(None, "model")]
    b: Bias


def apply(params: Dense, batch: dict[str, X], scale) -> dict[str, Y]:
    return {k: v @ params.w + params.b * scale for k, v in batch.items()}


def test_trees_fields_and_unannotated_leaves(mesh):
    f = _derived(apply)
    params = Dense(place(mesh, (4, 2), P(None, "model")), place(mesh, (2,), P("model")))
    batch = {"a": np.ones((8, 4), np.float32)}
    with jax.set_mesh(mesh):
        out = f(params, batch, 2.0)
        compiled = f.lower(params, batch, 2.0).compile()
    assert out["a"].sharding.spec == P("data", "model")
    (dense, tree, _), _ = compiled.input_shardings
    # `b` has no sharding in its annotation: it keeps its own, not replicated.
    assert dense.b.spec == P("model")
    assert tree["a"].is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    wrong = {"a": place(mesh, (8, 4), P(None, "data"))}
    with pytest.raises(jts.ShardingTypeCheckError, match=r"`batch\['a'\]` is"):
        f(params, wrong, 2.0)
    wrong_w = Dense(place(mesh, (4, 2), P()), params.b)
    with pytest.raises(jts.ShardingTypeCheckError, match="`params.w` is `float32"):
        f(wrong_w, batch, 2.0)


def test_derivation_follows_the_context_mesh():
    first, second = _mesh(AxisType.Explicit), _mesh(AxisType.Explicit, (2, 4))
    f = _derived()
    x, w = np.ones((8, 4), np.float32), np.ones((4, 4), np.float32)
    with jax.set_mesh(first):
        a = f(x, w)
        assert f(x, w).sharding == a.sharding  # warm: the same derived jit
    with jax.set_mesh(second):
        b = f(x, w)
    assert a.sharding.mesh is first and b.sharding.mesh is second
    assert b.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(f._cache) == 2


def test_static_arguments_and_checks_still_run(mesh):
    @jaxtyped(typechecker=beartype)
    def scaled(x: X, k: int) -> X:
        return x * k

    f = _derived(scaled, static_argnums=1)
    x = np.ones((8, 4), np.float32)
    with jax.set_mesh(mesh):
        assert float(f(x, 3).sum()) == 96.0
        assert f(x, k=2).sharding.spec == P("data", None)
        with pytest.raises(Exception, match="k"):
            f(x, "3")  # beartype still checks the static argument


def test_only_in_or_only_out(mesh):
    f = jts.jit(layer, in_shardings="annotations")
    g = jts.jit(layer, out_shardings="annotations")
    x, w = place(mesh, (8, 4), P("data", None)), place(mesh, (4, 2), P(None, "model"))
    assert f(x, w).sharding.spec == P("data", "model")
    with jax.set_mesh(mesh):
        assert g(x, w).sharding.spec == P("data", "model")
        assert f.lower(x, w).compile().input_shardings[0][1].spec == P(None, "model")


def test_bad_spellings():
    with pytest.raises(ValueError, match="the only string accepted"):
        jts.jit(layer, in_shardings="annotation")
    with pytest.raises(ValueError, match="reshard_inputs=True needs"):
        jts.jit(layer, reshard_inputs=True)

    def kwonly(x: X, *, y: X) -> X:
        return x + y

    f = jts.jit(kwonly, in_shardings="annotations")
    with jax.set_mesh(_mesh(AxisType.Explicit)):
        with pytest.raises(TypeError, match=r"keyword-only arguments \['y'\]"):
            f(jnp.ones((8, 4)), y=jnp.ones((8, 4)))


def test_no_mesh_is_an_error():
    f = _derived()
    with pytest.raises(ValueError, match="needs a mesh"):
        f(np.ones((8, 4), np.float32), np.ones((4, 2), np.float32))


def test_inside_another_trace_the_outer_one_places(mesh):
    @jaxtyped(typechecker=beartype)
    def double(x: X) -> X:
        return x * 2

    f = _derived(double)
    x = place(mesh, (8, 4), P("data", None))
    with jax.set_mesh(mesh):
        assert float(jax.jit(lambda x: f(x).sum())(x)) == 2 * float(x.sum())
        grad = jax.grad(lambda x: f(x).sum())(x)
    np.testing.assert_array_equal(np.asarray(grad), np.full((8, 4), 2.0))
    assert f(x).sharding.spec == P("data", None)  # then at top level again


def test_equinox_module_fields_and_no_transfer_on_mismatch(mesh):
    class Linear(eqx.Module):
        w: W
        b: Bias

    def apply(m: Linear, x: X) -> Y:
        return x @ m.w + m.b

    f = _derived(apply)
    x = place(mesh, (8, 4), P("data", None))
    m = Linear(np.ones((4, 2), np.float32), np.ones(2, np.float32))
    with jax.set_mesh(mesh):
        compiled = f.lower(m, x).compile()
        assert compiled.input_shardings[0][0].w.spec == P(None, "model")
        assert f(m, x).sharding.spec == P("data", "model")
    bad = Linear(place(mesh, (4, 2), P("model", None)), place(mesh, (2,), P()))
    with jax.transfer_guard("disallow"):
        with pytest.raises(jts.ShardingTypeCheckError, match="`m.w` is `float32"):
            f(bad, x)
