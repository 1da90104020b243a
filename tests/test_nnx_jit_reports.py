"""`jts.nnx_jit` steps in `preflight` and `collectives` (issue 34, item 5): the
step is given with its graph nodes, and the state it updates in place is
checked and counted."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .test_nnx_jit import (
    AFTER,
    BATCH,
    explicit,
    loss_and_update,
    make_state,
    mesh_with_rules,  # noqa: F401  (the `mesh` fixture)
    MODEL,
    nnx,
    OPT,
    planted_step,
    replicated,
    RULES,
    train_step,
)


def test_preflight_counts_and_checks_the_updated_state(mesh):
    model, optimizer, batch = make_state(mesh)
    report = jts.preflight(train_step, model, optimizer, batch, mesh=mesh)
    checks = report.checks
    # On entry: every param, moment and batch leaf; after: the graph nodes again.
    assert checks.leaves_checked == 2 * (MODEL + OPT) + BATCH
    paths = {row.path for row in report.leaves}
    assert "outputs['model'].linear1.kernel.value" in paths
    assert "outputs['optimizer'].opt_state[0].nu['linear2']['kernel'].value" in paths
    assert set(checks.unannotated) == {
        "optimizer.opt_state[0].count.value",
        "optimizer.step.value",
        "outputs['optimizer'].opt_state[0].count.value",
        "outputs['optimizer'].step.value",
        "outputs['return']",
    }
    if not explicit(mesh):  # compiled on the mesh: XLA's layouts checked too
        assert checks.compile_time > 0 and checks.compiled_on is not None
    # Nothing ran: the model is as it was.
    assert int(optimizer.step.get_value()) == 0


def test_preflight_on_a_larger_abstract_mesh(mesh):
    model, optimizer, batch = make_state(mesh)
    pod = AbstractMesh((4, 4), ("data", "model"), axis_types=mesh.axis_types)
    report = jts.preflight(train_step, model, optimizer, batch, mesh=pod)
    assert report.checks.leaves_checked == 2 * (MODEL + OPT) + BATCH
    (kernel,) = [r for r in report.leaves if r.path == "model.linear1.kernel.value"]
    assert kernel.bytes_per_device == 8 * 16 * 4 // 4  # 16 columns over 'model': 4


def test_preflight_names_a_wrong_update_by_path(mesh):
    model, optimizer, batch = make_state(mesh)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(planted_step, model, optimizer, batch, bad="param", mesh=mesh)
    text = str(info.value)
    assert "preflight of `planted_step`" in text and "1 sharding mismatch" in text
    assert "`model.linear1.kernel.value` of `planted_step, after its in-place" in text


def test_preflight_names_a_misplaced_param_on_entry(mesh):
    model, optimizer, batch = make_state(mesh)
    kernel = model.linear2.kernel
    kernel.set_value(jax.device_put(kernel.get_value(), NamedSharding(mesh, P())))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(train_step, model, optimizer, batch, mesh=mesh)
    text = str(info.value)
    assert "model.linear2.kernel.value" in text and "linear1" not in text


def test_collectives_of_a_step_with_graph_nodes(mesh):
    model, optimizer, batch = make_state(mesh)
    report = jts.collectives(train_step, model, optimizer, batch)
    assert report.function == "train_step"
    assert report.where(kind="all-reduce", axes="data").count >= 1  # the grads
    assert int(optimizer.step.get_value()) == 0  # compiled, never run
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.collectives(planted_step, model, optimizer, batch, bad="moment")
    assert "optimizer.opt_state[0].nu['linear2']['kernel'].value" in str(info.value)
    assert AFTER in str(info.value)


@jts.nnx_jit
def overwrite_step(model, optimizer, batch, new):
    loss = loss_and_update(model, optimizer, batch)
    model.linear1.kernel.set_value(new)  # no constraint: the input's layout
    return loss


def test_param_replaced_by_a_replicated_input(mesh):
    """No sharding constraint in the step: on Auto axes only XLA knows the
    updated value's layout, and the check when it compiles names it."""
    model, optimizer, batch = make_state(mesh)
    new = jax.device_put(jnp.zeros((8, 16)), NamedSharding(mesh, P()))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        overwrite_step(model, optimizer, batch, new)
    text = str(info.value)
    assert "model.linear1.kernel.value" in text and "P(None, 'model')" in text
    if explicit(mesh):
        assert f"nnx_jit(overwrite_step), {AFTER}" in text
    else:
        assert "while compiling `overwrite_step`" in text
        assert "of `overwrite_step, after its in-place updates`" in text
    # Placed as the param is, the same step passes.
    good = jax.device_put(new, NamedSharding(mesh, P(None, "model")))
    overwrite_step(model, optimizer, batch, good)
    assert nnx.state(model, nnx.Param) is not None


class Plain(nnx.Module):
    """The MLP's structure, with no partitioning metadata: an EMA's copy."""

    def __init__(self, rngs):
        self.linear1 = nnx.Linear(8, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 8, rngs=rngs)


def variables(module):
    return jax.tree.leaves(module, is_leaf=lambda x: isinstance(x, nnx.Variable))


@jts.nnx_jit(static_argnums=2)
def ema_step(model, shadow: jts.Like["model"], bad):  # noqa: F821
    for new, old in zip(variables(model), variables(shadow)):
        old.set_value(0.9 * old.get_value() + 0.1 * new.get_value())
    if bad:
        shadow.linear1.kernel.set_value(replicated(shadow.linear1.kernel.get_value()))


def test_like_the_model_after_the_update(mesh):
    model, _, _ = make_state(mesh)
    with nnx.use_eager_sharding(False):
        shadow = Plain(nnx.Rngs(1))
    for new, old in zip(variables(model), variables(shadow)):
        old.set_value(jax.device_put(old.get_value(), new.get_value().sharding))
    ema_step(model, shadow, False)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        ema_step(model, shadow, True)
    text = str(info.value)
    assert "shadow.linear1.kernel.value" in text and "P(None, 'model')" in text
    if explicit(mesh):
        assert f"{AFTER}: 1 of {2 * MODEL} checked leaves" in text


def test_preflight_and_collectives_under_the_steps_own_rules(mesh):
    def step(model, optimizer, batch):
        return loss_and_update(model, optimizer, batch)

    model, optimizer, batch = make_state(mesh)
    own = jts.nnx_jit(step, axis_rules=RULES)
    with jts.axis_rules(None):  # no table in force: the step's holds
        report = jts.preflight(own, model, optimizer, batch, mesh=mesh)
        assert report.checks.leaves_checked == 2 * (MODEL + OPT)
        assert jts.collectives(own, model, optimizer, batch).function.endswith("step")
        swapped = jts.nnx_jit(step, axis_rules={"embed": "model", "mlp": None})
        with pytest.raises(jts.ShardingTypeCheckError, match=r"linear1\.kernel"):
            jts.preflight(swapped, model, optimizer, batch, mesh=mesh)
