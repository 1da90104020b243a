"""`jts.reshard` and `jts.out_sharding`: an annotation lays a value out on any mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh


W = Float[Array, "embed mlp", jts.Logical]
Used = Float[Array, "embed mlp", jts.Logical("act_embed", "mlp")]
Hidden = Float[Array, "b e", jts.Logical("batch", "act_embed")]
FSDP_TP = {"embed": "data", "mlp": "model", "act_embed": None, "batch": "data"}


def _mixed(kinds):
    import numpy as np
    from jax.sharding import Mesh

    devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
    return Mesh(devices, ("data", "model"), axis_types=kinds)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "embed mlp", P("data", "model")]
    scale: Float[Array, " mlp"]  # no sharding: left as it is


def test_eager_places_as_annotated(mesh_4x2):
    with jax.set_mesh(mesh_4x2), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((16, 8)), W)
        assert w.sharding.spec == P("data", "model")
        assert jts.reshard(w, Used).sharding.spec == P(None, "model")
    # Outside the rules and the context mesh: the array's own mesh.
    assert jts.reshard(w, P(None, "data")).sharding.spec == P(None, "data")


def test_in_jit_explicit_changes_the_type(mesh_explicit):
    with jax.set_mesh(mesh_explicit), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((16, 8)), W)
        seen = []

        def f(w):
            used = jts.reshard(w, Used)
            seen.append(jax.typeof(used).sharding.spec)
            return used

        out = jax.jit(f)(w)
    assert seen == [P(None, "model")]
    assert out.sharding.spec == P(None, "model")


@pytest.mark.parametrize(
    "kinds",
    [
        (AxisType.Auto, AxisType.Auto),
        (AxisType.Explicit, AxisType.Auto),
        (AxisType.Auto, AxisType.Explicit),
    ],
)
def test_in_jit_auto_and_mixed(kinds):
    mesh = _mixed(kinds)
    with jax.set_mesh(mesh), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((16, 8)), W)
        x = jts.reshard(jnp.ones((8, 16)), Hidden)

        def f(x, w):
            used = jts.reshard(w, Used)
            h = jnp.einsum("be,em->bm", x, used)
            # Row-parallel: a contraction over `model`; out_sharding where needed.
            y = jnp.einsum("bm,em->be", h, used, out_sharding=jts.out_sharding(Hidden))
            return jts.reshard(y, Hidden), used

        y, used = jax.jit(f)(x, w)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    assert used.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert jnp.allclose(y, 16 * 8 * jnp.ones((8, 16)))


def test_gradient_laid_out_as_the_input(mesh_4x2):
    # `params = jts.reshard(params)` in a loss: the gradient comes back laid out as
    # the parameter, on Auto meshes too (there XLA would otherwise choose).
    with jax.set_mesh(mesh_4x2), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((16, 8)), W)
        x = jts.reshard(jnp.ones((8, 16)), Hidden)

        def loss(w, x):
            w = jts.reshard(w, W)
            return (jnp.einsum("be,em->bm", x, jts.reshard(w, Used)) ** 2).sum()

        grad = jax.jit(jax.grad(loss))(w, x)
    assert grad.sharding.is_equivalent_to(w.sharding, 2)
    assert jax.device_get(grad).max() == pytest.approx(2 * 16 * 8)


def test_tree_by_its_fields_and_by_one_annotation(mesh_4x2):
    dense = Dense(jnp.ones((16, 8)), jnp.ones(8))
    with jax.set_mesh(mesh_4x2):
        placed = jts.reshard(dense)
        assert placed.w.sharding.spec == P("data", "model")
        assert placed.scale is dense.scale  # no sharding: untouched
        inside = jax.jit(lambda d: jts.reshard(d))(dense)
        assert inside.w.sharding.spec == P("data", "model")
        every = jts.reshard({"a": jnp.ones((8, 2)), "b": jnp.ones((8, 4))}, P("data"))
        assert {k: v.sharding.spec for k, v in every.items()} == {
            "a": P("data", None),
            "b": P("data", None),
        }
        by_tree = jts.reshard(dense, Dense)  # a type hint, as `shardings` takes
        assert by_tree.w.sharding.spec == P("data", "model")


def test_rules_in_force_at_trace_time(mesh_explicit):
    # The rules are part of JAX's cache key: a second table traces again.
    f = jax.jit(lambda w: jts.reshard(w, W))
    with jax.set_mesh(mesh_explicit):
        w = jnp.ones((16, 8))
        with jts.axis_rules(FSDP_TP):
            assert f(w).sharding.spec == P("data", "model")
        with jts.axis_rules({"embed": None, "mlp": "data"}):
            assert f(w).sharding.spec == P(None, "data")
        with jts.axis_rules(FSDP_TP):
            assert f(w).sharding.spec == P("data", "model")


def test_out_sharding_by_mesh_kind():
    assert jts.out_sharding(Float[Array, "b e", P("data")]) is None  # no mesh
    with jts.axis_rules(FSDP_TP):
        for kinds, expected in [
            ((AxisType.Explicit,) * 2, P("data", None)),
            ((AxisType.Auto,) * 2, None),
            ((AxisType.Auto, AxisType.Explicit), P(None, None)),
            ((AxisType.Explicit, AxisType.Auto), P("data", None)),
        ]:
            with jax.set_mesh(_mixed(kinds)):
                assert jts.out_sharding(Hidden) == expected, kinds


def test_errors(mesh_explicit):
    x = jnp.ones((8, 4))
    with jax.set_mesh(mesh_explicit):
        with pytest.raises(jts.ShardingAnnotationError, match="has no sharding"):
            jts.reshard(x, Float[Array, "b e"])
        with pytest.raises(jts.ShardingAnnotationError, match="'modle'"):
            jts.reshard(x, P("modle"))
        with pytest.raises(jts.ShardingAnnotationError, match="'modle'"):
            jax.jit(lambda x: jts.reshard(x, P("modle")))(x)
        with pytest.raises(jts.ShardingAnnotationError, match="no rule|rules"):
            jts.reshard(x, Hidden)  # logical names, no rules in force

        def body(x):
            return jts.reshard(x, P("data"))

        mapped = jax.shard_map(
            body, mesh=mesh_explicit, in_specs=P("data"), out_specs=P("data")
        )
        with pytest.raises(jts.ShardingAnnotationError, match="inside `shard_map`"):
            jax.jit(mapped)(jax.device_put(x, NamedSharding(mesh_explicit, P("data"))))
    with pytest.raises(ValueError, match="needs a mesh"):
        jax.jit(lambda x: jts.reshard(x, P("data")))(x)


def test_helper_meshes_match_plugin():
    # The fixtures' meshes are the plugin's (first 8 devices, row-major).
    assert make_mesh((4, 2), ("data", "model")).devices.shape == (4, 2)


def test_auto_constrained_value_checked_at_trace_time(mesh_auto):
    # On Auto axes a value `jts.reshard` constrained is decided when traced: XLA
    # keeps the constraint, and would propagate it backwards to values traced
    # earlier, which the compile-time report would list first.
    from beartype import beartype

    Row = Float[Array, "b e", P("data", None)]

    @jts.jaxtyped(typechecker=beartype)
    def consume(x: Row) -> Row:
        return x

    def good(x):
        return consume(jts.reshard(x * 2, Row))

    def bad(x):
        return consume(jts.reshard(x * 2, P("data", "model")))

    with jax.set_mesh(mesh_auto):
        x = jts.reshard(jnp.ones((8, 4)), Row)
        jax.jit(good).trace(x)  # nothing raised
        with pytest.raises(jts.ShardingTypeCheckError) as caught:
            jax.jit(bad).trace(x)  # traced only: nothing compiled
    text = str(caught.value)
    assert text.startswith("argument `x` of `") and ".consume`" in text
    assert "laid out as `float32[8@data,4@model]` by a sharding constraint" in text
    assert "checked at trace time" in text
    # Off: nothing is checked, at trace time or later.
    with jax.set_mesh(mesh_auto), jts.set_mode("off"):
        jax.jit(bad)(x)
