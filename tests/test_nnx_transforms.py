"""Flax NNX's transforms and trees with the checks on: split / merge / state,
nnx.jit, jts.jit, nnx.eval_shape, sharded_init, nnx.vmap (stacked), nnx.Optimizer."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES


nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

RULES = {"embed": "data", "mlp": "model", "layers": None}


class Mlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(init(rngs.params(), (8, 16)), out_sharding=("embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((16,)), out_sharding=("mlp",))


def make():
    with nnx.use_eager_sharding(False):
        return Mlp(nnx.Rngs(0))


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


@pytest.fixture
def scope(mesh):
    # One table for both: Flax reads its own rules in `nnx.eval_shape` (Auto
    # axes) and in its eager sharding.
    with jts.axis_rules(RULES), nnx.logical_axis_rules(jts.flax_rules()):
        with jax.set_mesh(mesh):
            yield mesh


def _placed(mesh):
    model = make()
    return jax.device_put(model, jts.shardings(model, mesh=mesh))


def _replicate_w(model, mesh):
    model.w.set_value(jax.device_put(model.w.get_value(), NamedSharding(mesh, P())))
    return model


def test_split_merge_state(scope):
    mesh = scope
    graph, state = nnx.split(_placed(mesh))
    assert jts.shardings(state, mesh=mesh)["w"].get_value().spec == P("data", "model")
    jts.check_tree(state, name="state")
    jts.check_tree(nnx.merge(graph, state))
    jts.check_tree(nnx.state(_placed(mesh), nnx.Param))
    graph, bad = nnx.split(_replicate_w(_placed(mesh), mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"state\['w'\]\.value"):
        jts.check_tree(bad, name="state")


def test_nnx_jit_check_inside(scope):
    mesh = scope

    @nnx.jit
    def step(model):
        jts.check_tree(model, name="model")
        return model.w.get_value().sum()

    step(_placed(mesh))
    step(_placed(mesh))  # warm: JAX's cache
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w\.value"):
        step(_replicate_w(_placed(mesh), mesh))
    step(_placed(mesh))  # and the passing call again


def test_jts_jit_boundary(scope):
    mesh = scope

    @jts.jit
    def step(model):
        return model.w.get_value().sum()

    step(_placed(mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w\.value"):
        step(_replicate_w(_placed(mesh), mesh))


def test_eval_shape_and_sharded_init(scope):
    mesh = scope
    abstract = nnx.eval_shape(make)
    got = jts.shardings(abstract, mesh=mesh)
    assert got.w.get_value().spec == P("data", "model")
    assert got.b.get_value().spec == P("model")
    model = jts.sharded_init(make, mesh=mesh)
    assert model.w.get_value().sharding.is_equivalent_to(
        NamedSharding(mesh, P("data", "model")), 2
    )
    jts.check_tree(model)


def test_vmap_stacked_axis(scope):
    mesh = scope

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stack(key):
        with nnx.use_eager_sharding(False):
            return Mlp(nnx.Rngs(key))

    layers = stack(jax.random.split(jax.random.key(0), 3))
    assert layers.w.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    got = jts.shardings(layers, mesh=mesh)
    assert got.w.get_value().spec == P(None, "data", "model")
    placed = jax.device_put(layers, got)
    jts.check_tree(placed)
    with jts.axis_rules({**RULES, "layers": "model", "mlp": None}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"\.w\.value"):
            jts.check_tree(placed)


def test_optimizer_state_follows_the_params(scope):
    """NNX copies a Param's metadata onto its optimizer state (`OptVariable`): mu
    and nu are checked with no annotation written for them."""
    mesh = scope
    model = _placed(mesh)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    jts.check_tree(opt, name="optimizer")
    mu = opt.opt_state[0][1]["w"]
    assert mu.get_value().sharding.is_equivalent_to(
        NamedSharding(mesh, P("data", "model")), 2
    )
    mu.set_value(jax.device_put(mu.get_value(), NamedSharding(mesh, P())))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(opt, name="optimizer")
    text = str(info.value)
    assert "optimizer.opt_state[0].mu['w'].value" in text
    assert "1 of 4 checked leaves" in text  # mu and nu of w and b; only mu of w


def test_scan_over_stacked_layers(scope):
    """Inside `nnx.scan` each layer's metadata loses the stacked axis, and the
    layer is checked as one."""
    mesh = scope
    meta = {nnx.PARTITION_NAME: "layers"}

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=meta)
    def stack(key):
        with nnx.use_eager_sharding(False):
            return Mlp(nnx.Rngs(key))

    layers = stack(jax.random.split(jax.random.key(0), 3))
    layers = jax.device_put(layers, jts.shardings(layers, mesh=mesh))
    seen = []

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata=meta)
    def run(layer, x):
        seen.append(layer.w.get_metadata()["out_sharding"])
        jts.check_tree(layer, name="layer")
        return x + jnp.sum(layer.w[...])

    run(layers, jnp.zeros(()))
    assert seen == [("embed", "mlp")]
    with jts.axis_rules({**RULES, "mlp": None}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layer\.w\.value"):
            run(layers, jnp.zeros(()))


def test_plain_optax_state_over_nnx_params_follows_them(scope):
    """An optax state made from `nnx.state(model, nnx.Param)` (without
    nnx.Optimizer) holds Variables too, metadata included (JAX keeps a pytree
    node's aux data through `tree_map`): checked with nothing written."""
    mesh = scope
    params = nnx.state(_placed(mesh), nnx.Param)
    state = optax.adam(1e-3).init(params)
    summary = jts.check_tree(state, name="opt_state", summary=True)
    assert summary.checked == 4  # mu and nu of w and b
    bad = optax.adam(1e-3).init(
        jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    )
    with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.mu\['w'\]"):
        jts.check_tree(bad, name="opt_state")


def test_nnx_jit_rules_change_retraces(scope):
    """Warm under one table, change it, call again: JAX's caches do not skip the
    check (the rules are in their key), and the first table passes again."""
    mesh = scope

    @nnx.jit
    def step(model):
        jts.check_tree(model, name="model")
        return model.w.get_value().sum()

    model = _placed(mesh)
    step(model)
    with jts.axis_rules({**RULES, "embed": None}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w\.value"):
            step(model)
    step(model)
