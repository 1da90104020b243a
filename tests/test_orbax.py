"""Orbax: the whole training state (parameters, optax state, step) saved, then
restored onto a target from `jts.abstract`, on the same layout and on others
(another mesh, another rules table), verified by `jts.check_tree`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float


ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")

FSDP = {"embed": "fsdp", "mlp": None}
FSDP_TP = {"embed": "fsdp", "mlp": "tensor"}
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w_in: Float[Array, "embed mlp", jts.Logical]
    w_out: Float[Array, "mlp embed", jts.Logical]
    bias: Float[Array, " mlp"]  # unannotated: replicated


def init(key):
    k1, k2 = jax.random.split(key)
    return Params(
        jax.random.normal(k1, (16, 32)),
        jax.random.normal(k2, (32, 16)),
        jnp.zeros((32,)),
    )


def loss(params):
    # Elementwise only: no contraction over a sharded dim to settle.
    return (
        jnp.sum(jnp.tanh(params.w_in)) + jnp.sum(params.w_out**2) + jnp.sum(params.bias)
    )


OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def mesh_of(shape, names, kind):
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(KINDS[kind],) * len(names))


def trained(mesh, rules):
    """A training state after two optimiser steps, laid out by `rules`."""
    with jts.axis_rules(rules):
        params = jts.sharded_init(init, jax.random.key(0), mesh=mesh)
    step = jax.device_put(jnp.int32(0), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        return _steps({"params": params, "opt_state": OPT.init(params), "step": step})


def _steps(state):
    for _ in range(2):
        grads = jax.grad(loss)(state["params"])
        updates, opt_state = OPT.update(grads, state["opt_state"], state["params"])
        state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
    return state


def target(mesh, rules):
    """The restore target: parameters from `jts.abstract`; the optimiser state
    from `jts.abstract(OPT.init, ...)`, its params-shaped moments laid out as
    the parameters (`optax.tree_map_params`)."""
    with jts.axis_rules(rules):
        params = jts.abstract(init, jax.random.key(0), mesh=mesh)
        opt_state = jts.abstract(OPT.init, params, mesh=mesh)
    opt_state = optax.tree_map_params(
        OPT,
        lambda moment, p: jax.ShapeDtypeStruct(
            moment.shape, moment.dtype, sharding=p.sharding
        ),
        opt_state,
        params,
    )
    replicated = NamedSharding(mesh, P())
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return {"params": params, "opt_state": opt_state, "step": step}


def moments(opt_state):
    adam = opt_state[1][0]  # chain(clip, adamw): adamw's scale_by_adam state
    return adam.mu, adam.nu


def verify(restored, mesh, rules):
    """Every annotated leaf as the rules lay it out on `mesh`, the moments as
    the parameters; the step and counts replicated."""
    with jts.axis_rules(rules):
        params = jts.check_tree(restored["params"], name="params")
        for i, moment in enumerate(moments(restored["opt_state"])):
            jts.check_tree(moment, like=params, name=f"moment{i}")
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.mesh.devices.size == mesh.devices.size
    replicated = NamedSharding(mesh, P())
    assert restored["step"].sharding.is_equivalent_to(replicated, 0)


def same_values(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(params=list(KINDS))
def saved(request, tmp_path):
    """A state trained as FSDP on 8 devices and saved with Orbax."""
    kind = request.param
    mesh = mesh_of((8,), ("fsdp",), kind)
    state = trained(mesh, FSDP)
    verify(state, mesh, FSDP)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
    return kind, path, state


def restore(path, abstract_state):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract_state)


def test_restore_same_layout(saved):
    kind, path, state = saved
    mesh = mesh_of((8,), ("fsdp",), kind)
    restored = restore(path, target(mesh, FSDP))
    verify(restored, mesh, FSDP)
    same_values(restored, state)
    assert int(restored["step"]) == 2


def test_restore_onto_fsdp_tp_4x2(saved):
    kind, path, state = saved
    mesh = mesh_of((4, 2), ("fsdp", "tensor"), kind)
    restored = restore(path, target(mesh, FSDP_TP))
    verify(restored, mesh, FSDP_TP)
    w_in = restored["params"].w_in.sharding
    assert w_in.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tensor")), 2)
    same_values(restored, state)


def test_restore_onto_4_devices(saved):
    kind, path, state = saved
    mesh = mesh_of((4,), ("fsdp",), kind)
    restored = restore(path, target(mesh, FSDP))
    verify(restored, mesh, FSDP)
    assert restored["params"].w_in.addressable_shards[0].data.shape == (4, 32)
    same_values(restored, state)


def test_wrong_target_caught_after_restore(saved):
    # A target built for the FSDP table, checked under FSDP + TP: each weight
    # (and each moment) is named by key path.
    kind, path, _ = saved
    mesh = mesh_of((4, 2), ("fsdp", "tensor"), kind)
    restored = restore(path, target(mesh, FSDP))
    with jts.axis_rules(FSDP_TP):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"params\.w_in") as error:
            jts.check_tree(restored["params"], name="params")
    assert "params.w_out" in str(error.value)
    with jts.axis_rules(FSDP_TP):
        wanted = jts.abstract(init, jax.random.key(0), mesh=mesh)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"moment\.w_in"):
            jts.check_tree(
                moments(restored["opt_state"])[0], like=wanted, name="moment"
            )


def test_checkpoint_manager_resumes_on_another_mesh(tmp_path):
    mesh = mesh_of((8,), ("fsdp",), "explicit")
    state = trained(mesh, FSDP)
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(2, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    other = mesh_of((4, 2), ("fsdp", "tensor"), "explicit")
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        step = manager.latest_step()
        restored = manager.restore(
            step, args=ocp.args.StandardRestore(target(other, FSDP_TP))
        )
    assert step == 2
    verify(restored, other, FSDP_TP)
    same_values(restored, state)
