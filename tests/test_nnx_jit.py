"""`jts.nnx_jit` (issue 34, item 5): a Flax NNX train step, as Flax's guide writes
it, checked on entry and again after its in-place updates, by key path, on
Explicit and Auto meshes, through JAX's caches."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh


nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

RULES = {"embed": None, "mlp": "model"}
Batch = dict[str, Float[Array, "b e", P("data", None)]]
AFTER = "after the step's in-place updates"
# Checked leaves: 4 params; adamw's mu and nu of each (its count and the
# optimizer's step declare nothing); the batch's x and y.
MODEL, OPT, BATCH = 4, 8, 2


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        zeros = nnx.initializers.zeros_init()
        self.linear1 = nnx.Linear(
            8, 16,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )  # fmt: skip
        self.linear2 = nnx.Linear(
            16, 8,
            kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )  # fmt: skip

    def __call__(self, x):
        explicit = jax.sharding.get_abstract_mesh().axis_types[0] == AxisType.Explicit
        out = P("data", None) if explicit else None  # contracting over 'model'
        return self.linear2(nnx.relu(self.linear1(x)), out_sharding=out)


def loss_and_update(model, optimizer, batch):
    def loss_fn(model):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@jts.nnx_jit
def train_step(model: MLP, optimizer: nnx.Optimizer, batch: Batch):
    return loss_and_update(model, optimizer, batch)


def replicated(value):
    """`value` laid out replicated, inside the trace, as a step would do it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.axis_types[0] == AxisType.Explicit:
        return jax.sharding.reshard(value, P())
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, P()))


def explicit(mesh):
    return mesh.axis_types[0] == AxisType.Explicit


@pytest.fixture(name="mesh", params=["explicit", "auto"])
def mesh_with_rules(request):
    """The 4x2 mesh, both kinds, set with the rules in force (also the reports'
    tests' fixture, imported there)."""
    mesh = make_mesh((4, 2), ("data", "model"), request.param)
    with jts.axis_rules(RULES), nnx.logical_axis_rules(jts.flax_rules()):
        with jax.set_mesh(mesh):
            yield mesh


def make_state(mesh):
    model = jts.sharded_init(lambda: MLP(nnx.Rngs(0)), mesh=mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = jts.place({"x": jnp.ones((8, 8)), "y": jnp.zeros((8, 8))}, Batch, mesh)
    return model, optimizer, batch


def misplace(variable, mesh):
    value = jax.device_put(variable.get_value(), NamedSharding(mesh, P()))
    variable.set_value(value)


def test_correct_step_runs_and_updates_in_place(mesh):
    model, optimizer, batch = make_state(mesh)
    before = model.linear1.kernel.get_value()
    losses = [float(train_step(model, optimizer, batch)) for _ in range(3)]
    assert losses[2] < losses[0]  # it trained: the updates were written back
    assert not jnp.allclose(model.linear1.kernel.get_value(), before)
    assert int(optimizer.step.get_value()) == 3
    kernel = model.linear1.kernel.get_value()
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    summary = jts.check_tree((model, optimizer), summary=True)
    assert summary.checked == MODEL + OPT  # every param and moment, after 3 steps


def test_misplaced_param_on_entry_is_named(mesh):
    model, optimizer, batch = make_state(mesh)
    misplace(model.linear1.kernel, mesh)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        train_step(model, optimizer, batch)
    text = str(info.value)
    assert "model.linear1.kernel.value" in text and "linear2" not in text
    assert "train_step" in text
    if explicit(mesh):  # decided at trace time, with every leaf counted
        assert "nnx_jit(train_step), arguments" in text
        assert f"1 of {MODEL + OPT + BATCH} checked leaves" in text
    else:  # what XLA placed, checked when it compiles
        assert "while compiling `train_step`" in text


def test_misplaced_moment_on_entry_is_named(mesh):
    model, optimizer, batch = make_state(mesh)
    misplace(optimizer.opt_state[0].mu["linear2"]["kernel"], mesh)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        train_step(model, optimizer, batch)
    text = str(info.value)
    assert "optimizer.opt_state[0].mu['linear2']['kernel'].value" in text
    assert "model." not in text


def test_misplaced_batch_is_named_by_the_steps_annotation(mesh):
    model, optimizer, batch = make_state(mesh)
    batch["y"] = jax.device_put(batch["y"], NamedSharding(mesh, P(None, "data")))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"batch\['y'\]"):
        train_step(model, optimizer, batch)


@jts.nnx_jit(static_argnames="bad")
def planted_step(model, optimizer, batch, bad=None):
    loss = loss_and_update(model, optimizer, batch)
    if bad == "param":  # the update replaces a param with a replicated value
        model.linear1.kernel.set_value(replicated(model.linear1.kernel.get_value()))
    if bad == "moment":
        nu = optimizer.opt_state[0].nu["linear2"]["kernel"]
        nu.set_value(replicated(nu.get_value()))
    return loss


@pytest.mark.parametrize(
    "bad, path, spec",
    [
        ("param", "model.linear1.kernel.value", "P(None, 'model')"),
        (
            "moment",
            "optimizer.opt_state[0].nu['linear2']['kernel'].value",
            "P('model', None)",
        ),
    ],
)
def test_wrong_update_is_caught_after_the_step_by_path(mesh, bad, path, spec):
    model, optimizer, batch = make_state(mesh)
    planted_step(model, optimizer, batch)  # warm: the correct variant passes
    kernel = model.linear1.kernel.get_value()
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        planted_step(model, optimizer, batch, bad=bad)
    text = str(info.value)
    assert f"nnx_jit(planted_step), {AFTER}" in text
    assert f"1 of {MODEL + OPT} checked leaves" in text  # the graph nodes again
    assert path in text and spec in text
    # Refused inside the trace: nothing was written back.
    assert model.linear1.kernel.get_value() is kernel
    planted_step(model, optimizer, batch)  # and the correct variant, cached, again


def test_warm_step_called_with_a_misplaced_model(mesh):
    model, optimizer, batch = make_state(mesh)
    train_step(model, optimizer, batch)
    train_step(model, optimizer, batch)  # JAX's cache
    other, other_opt, _ = make_state(mesh)
    misplace(other.linear2.kernel, mesh)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.linear2\.kernel"):
        train_step(other, other_opt, batch)
    train_step(model, optimizer, batch)  # the good one still passes


def test_mode_off_checks_nothing_and_on_again_checks(mesh):
    model, optimizer, batch = make_state(mesh)
    with jts.set_mode("off"):  # nothing checked: the wrong update is written back
        planted_step(model, optimizer, batch, bad="moment")
    nu = optimizer.opt_state[0].nu["linear2"]["kernel"].get_value()
    assert nu.sharding.is_fully_replicated
    # Mode on: the same signature as the trace cached under "off" is traced again.
    fresh, fresh_opt, _ = make_state(mesh)
    with pytest.raises(jts.ShardingTypeCheckError, match=AFTER):
        planted_step(fresh, fresh_opt, batch, bad="moment")
    # And the state the unchecked step left is refused on entry.
    with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.nu"):
        planted_step(model, optimizer, batch)


def test_axis_rules_at_wrap_time(mesh):
    def step(model, optimizer, batch):
        return loss_and_update(model, optimizer, batch)

    model, optimizer, batch = make_state(mesh)
    swapped = {"embed": "model", "mlp": None}
    with jts.axis_rules(None):  # no table in force: the wrapper's holds
        jts.nnx_jit(step, axis_rules=RULES)(model, optimizer, batch)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"linear1\.kernel"):
            jts.nnx_jit(axis_rules=swapped)(step)(model, optimizer, batch)


def test_donation_passes_through(mesh):
    @jts.nnx_jit(donate_argnums=(0, 1))
    def step(model, optimizer, batch):
        return loss_and_update(model, optimizer, batch)

    model, optimizer, batch = make_state(mesh)
    old = model.linear1.kernel.get_value()
    step(model, optimizer, batch)
    assert old.is_deleted()  # donated to nnx.jit's jax.jit
    assert jts.check_tree(model, summary=True).checked == MODEL


def test_annotations_shardings_are_refused():
    with pytest.raises(ValueError, match="annotations"):
        jts.nnx_jit(in_shardings="annotations")(lambda model: model)


def test_graph_nodes_that_declare_nothing_are_not_a_pass(mesh):
    def step(model, x):
        return model(x).sum()

    with nnx.use_eager_sharding(False):
        plain = nnx.Linear(8, 8, rngs=nnx.Rngs(0))  # no partitioning metadata
    x = jnp.ones((4, 8))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.nnx_jit(step)(plain, x)
    text = str(info.value)
    assert "step), its graph nodes: none of its 2 array leaves" in text
    assert "model.kernel.value" in text and "model.bias.value" in text
    assert float(jts.nnx_jit(step, may_check_nothing=True)(plain, x)) != 0


class Tower(nnx.Module):
    def __init__(self, rngs):
        self.mlp = MLP(rngs)

    def __call__(self, x):
        return self.mlp(x)

    @jts.nnx_jit
    def train(self, optimizer, batch):  # a method, as nnx.jit decorates one
        return loss_and_update(self, optimizer, batch)


def test_method_and_stages(mesh):
    tower = jts.sharded_init(lambda: Tower(nnx.Rngs(0)), mesh=mesh)
    optimizer = nnx.Optimizer(tower, optax.adamw(1e-3), wrt=nnx.Param)
    _, _, batch = make_state(mesh)
    tower.train(optimizer, batch)
    misplace(tower.mlp.linear1.bias, mesh)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"self\.mlp\.linear1\.bias"):
        tower.train(optimizer, batch)
    # `.lower` traces with every check: the misplaced bias again, by path.
    model, optimizer, batch = make_state(mesh)
    train_step.lower(model, optimizer, batch)
    misplace(model.linear1.bias, mesh)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.linear1\.bias"):
        train_step.lower(model, optimizer, batch).compile()


@pytest.mark.parametrize("graph", [True, False])
def test_graph_and_tree_mode(mesh, graph):
    """`graph=` passes through to nnx.jit: in tree mode too the update is
    checked before it is written back."""

    @jts.nnx_jit(graph=graph, static_argnums=3)
    def step(model, optimizer, batch, bad):
        loss = loss_and_update(model, optimizer, batch)
        if bad:
            model.linear1.bias.set_value(replicated(model.linear1.bias.get_value()))
        return loss

    model, optimizer, batch = make_state(mesh)
    step(model, optimizer, batch, False)
    assert int(optimizer.step.get_value()) == 1  # written back
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        step(model, optimizer, batch, True)
    assert AFTER in str(info.value) and "model.linear1.bias.value" in str(info.value)
    assert int(optimizer.step.get_value()) == 1  # not written back


Out = dict[str, Float[Array, "b e", P("data", None)]]


def test_result_checked_by_the_steps_annotation(mesh):
    @jts.nnx_jit(static_argnums=2)
    def predict(model: MLP, batch: Batch, bad: bool) -> Out:
        y = model(batch["x"])
        return {"y": replicated(y) if bad else y}

    model, _, batch = make_state(mesh)
    out = predict(model, batch, False)
    assert out["y"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        predict(model, batch, True)
    text = str(info.value)
    assert "predict), return value" in text and "return['y']" in text
    assert "P('data', None)" in text
