"""Equinox modules: shardings, check_tree and the jts.jit boundary, end to end."""

import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS


X = Float[Array, "b embed"]
X1 = Float[Array, " n"]


class Mlp(eqx.Module):
    w_in: Float[Array, "embed@data mlp"]  # FSDP: weights split over data
    w_out: Float[Array, "mlp@data embed"]
    act: str = eqx.field(static=True, default="gelu")


class Model(eqx.Module):
    blocks: list[Mlp]
    head: Float[Array, "embed vocab", P("data", None)]


CheckedModel = jts.Tree[Model]


def init():
    blocks = [Mlp(jnp.ones((8, 16)), jnp.ones((16, 8))) for _ in range(2)]
    return Model(blocks, jnp.ones((8, 4)))


def loss(model, x):
    for block in model.blocks:
        x = jnp.tanh(x @ block.w_in) @ block.w_out
    return jnp.sum(x @ model.head)


def replicate(mesh, x):
    if mesh.axis_types[0] == AxisType.Explicit:
        return jax.sharding.reshard(x, NamedSharding(mesh, P()))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


@pytest.fixture
def model(mesh_4x2):
    return jax.jit(
        init, out_shardings=jts.shardings(eqx.filter_eval_shape(init), mesh_4x2)
    )()


def test_shardings_from_filter_eval_shape(mesh_4x2, model):
    target = jts.shardings(eqx.filter_eval_shape(init), mesh_4x2)
    assert target.blocks[1].w_out == NamedSharding(mesh_4x2, P("data", None))
    assert target.head.spec == P("data", None)
    assert target.blocks[0].act == "gelu"  # static fields stay in the structure
    assert model.blocks[1].w_in.sharding.is_equivalent_to(target.blocks[1].w_in, 2)
    jts.check_tree(model, name="model")


def test_train_step_checked_at_the_jit_boundary(mesh_4x2, model):
    """The issue's replicate-everything SGD update, caught without check_tree."""
    x = jnp.ones((4, 8))

    @jts.jit
    def step(model: Model, x) -> tuple[Model, Model]:
        grads = jax.grad(loss)(model, x)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)
        return new, grads

    @jts.jit
    def bad_step(model: Model, x) -> Model:
        grads = jax.grad(loss)(model, x)
        return jax.tree.map(lambda p, g: replicate(mesh_4x2, p - 0.1 * g), model, grads)

    for _ in range(2):  # warm caches: good, bad, good again
        new, grads = step(model, x)
        assert new.blocks[0].w_in.sharding.spec == P("data", None)
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            bad_step(model, x)
        text = str(info.value)
        paths = (".blocks[0].w_in", ".blocks[0].w_out", ".blocks[1].w_in", ".head")
        # At trace time on both kinds of mesh: on Auto axes each leaf is what a
        # sharding constraint made, which XLA keeps (tests/test_culprit_first.py).
        assert "5 of 5 checked leaves" in text
        assert all(f"return{path}: this traced array" in text for path in paths)


def test_field_swapped_with_tree_at(mesh_4x2, model):
    @jts.jit
    def forward(model: Model, x):
        return loss(model, x)

    x = jnp.ones((4, 8))
    forward(model, x)
    swapped = eqx.tree_at(lambda m: m.blocks[1].w_out, model, jnp.ones((16, 8)))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model.blocks\[1\].w_out"):
        forward(swapped, x)
    forward(model, x)


def test_grads_like_params(mesh_4x2, model):
    with jax.set_mesh(mesh_4x2):
        grads = eqx.filter_grad(loss)(model, jnp.ones((4, 8)))
    if mesh_4x2.axis_types[0] == AxisType.Auto:
        # Eager grad on Auto axes: XLA shards the gradients as it likes, not as
        # the parameters are. check_tree says so, leaf by leaf.
        with pytest.raises(jts.ShardingTypeCheckError, match=r"grads.blocks\[0\].w_in"):
            jts.check_tree(grads, like=model, name="grads")
        grads = jax.device_put(grads, jts.shardings(model, mesh_4x2))
    jts.check_tree(grads, like=model, name="grads")
    bad = eqx.tree_at(lambda g: g.head, grads, jnp.zeros((8, 4)))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"grads.head"):
        jts.check_tree(bad, like=model, name="grads")


def test_unannotated_third_party_modules_by_rules(mesh_explicit):
    linear = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    rules = {"weight": P(None, "data"), "bias": None}
    target = jts.shardings(linear, mesh_explicit, rules=rules)
    assert target.weight.spec == P(None, "data") and target.bias is None
    placed = jax.device_put(linear, target)
    jts.check_tree(placed, rules=rules, name="linear")
    with pytest.raises(jts.ShardingTypeCheckError, match=r"linear.weight"):
        jts.check_tree(linear, rules=rules, name="linear")
    ann = {"weight": P("data"), "bias": P()}
    by_tree = jts.shardings(linear, mesh_explicit, annotations=ann)
    assert by_tree.weight.spec == P("data", None)


def chain(error):
    """The text of an exception and of those it was raised from."""
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def test_tree_hint_under_jaxtyped(checker, mesh_explicit, model):
    if checker == "beartype":

        @jaxtyped(typechecker=beartype)
        def apply(model: CheckedModel, x: X):
            return loss(model, x)

    else:

        @jaxtyped(typechecker=None)
        @typechecked
        def apply(model: CheckedModel, x: X):
            return loss(model, x)

    x = jnp.ones((4, 8))
    apply(model, x)
    swapped = eqx.tree_at(lambda m: m.blocks[1].w_in, model, jnp.ones((8, 16)))
    with pytest.raises(CHECK_ERRORS) as info:
        apply(swapped, x)
    assert "Tree[Model]" in chain(info.value)
    if checker == "beartype":  # typeguard does not ask for the reason
        assert ".blocks[1].w_in`: this array" in chain(info.value)
        assert "1 of its 5 checked leaves" in chain(info.value)

    # A plain class hint checks the class only: this is what Tree adds.
    @jaxtyped(typechecker=beartype)
    def plain(model: Model):
        return model

    plain(swapped)


def test_tree_hint_errors():
    with pytest.raises(jts.ShardingAnnotationError, match="class or a generic"):
        jts.Tree[3]
    assert not isinstance([1], jts.Tree[Model])
    assert isinstance({"a": jnp.ones(2)}, jts.Tree[dict[str, X1]])
    assert not isinstance({"a": jnp.ones((2, 2))}, jts.Tree[dict[str, X1]])


def test_no_equinox_needed():
    # Importing the package leaves equinox alone; trees of dataclasses work with
    # equinox made unimportable.
    code = (
        "import sys\n"
        "import jaxtyping_shard as jts\n"
        "assert 'equinox' not in sys.modules\n"
        "sys.modules['equinox'] = None\n"
        "import dataclasses, jax, jax.numpy as jnp\n"
        "from jaxtyping import Array\n"
        "@jax.tree_util.register_dataclass\n"
        "@dataclasses.dataclass\n"
        "class D:\n"
        "    w: jts.Float[Array, 'a b@x']\n"
        "kind = jax.sharding.AxisType.Explicit\n"
        "mesh = jax.make_mesh((2,), ('x',), axis_types=(kind,))\n"
        "d = D(jnp.ones((2, 4)))\n"
        "d = jax.device_put(d, jts.shardings(d, mesh))\n"
        "jts.check_tree(d)\n"
        "jts.jit(lambda d: d)(d)\n"
        "assert sys.modules['equinox'] is None\n"
        "print('ok')\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
