"""Flax Linen boxes at the other surfaces (issue 34, item 1): `jts.filter_jit`,
`collectives`' annotated-function column, Orbax restore targets, field
annotations beside a box, path rules and annotation trees over boxes."""

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core import compat

from .helpers import MESHES


nn = pytest.importorskip("flax.linen")
ocp = pytest.importorskip("orbax.checkpoint")

RULES = [("batch", "data"), ("embed", "data"), ("mlp", "model")]
INIT = nn.initializers.lecun_normal()


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = nn.with_logical_partitioning(INIT, ("embed", "mlp"))
        h = nn.Dense(16, kernel_init=k, use_bias=False)(x)
        k = nn.with_logical_partitioning(INIT, ("mlp", "embed"))
        return nn.Dense(8, kernel_init=k, use_bias=False)(h)


X = jnp.ones((8, 8))


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


def _params(mesh):
    with jts.axis_rules(RULES):
        return jts.sharded_init(Mlp().init, jax.random.key(0), X, mesh=mesh)


def _replicate(tree, mesh, where="Dense_1"):
    def one(path, leaf):
        bad = where in jax.tree_util.keystr(path)
        return jax.device_put(leaf, NamedSharding(mesh, P())) if bad else leaf

    return jax.tree_util.tree_map_with_path(one, tree)


def test_filter_jit_boundary_reads_the_boxes(mesh):
    @jts.filter_jit
    def step(params, x):
        return jax.tree.map(lambda p: p * x, params)

    params = _params(mesh)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        step(params, 2.0)
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(_replicate(params, mesh), 2.0)
    assert "params['params']['Dense_1']['kernel'].value" in str(info.value)


def test_collectives_name_the_jitted_step():
    mesh = MESHES["auto"]()
    model = Mlp()

    @jts.jit
    def step(params, x):
        return model.apply(params, x)

    params = _params(mesh)
    x = jax.device_put(X, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        report = jts.collectives(step, params, x)
    assert report.rows, str(report)
    annotated = {s.annotated for row in report.rows for s in row.sources}
    if compat.hlo_stack_frames_usable():
        assert "step" in {a.rsplit(".", 1)[-1] for a in annotated if a}, str(report)
    else:
        # JAX 0.8 keeps one frame per op, the innermost outside JAX: for an op
        # made inside Flax (nn.Dense's dot_general) that is Flax's own line, and
        # no annotated function is known (docs/compat.md).
        files = {s.file.rsplit("/", 1)[-1] for row in report.rows for s in row.sources}
        assert "linear.py" in files, str(report)


def test_restore_target_from_a_linen_init():
    eight = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jts.axis_rules([("embed", "data"), ("mlp", None)]):
        params = jts.sharded_init(Mlp().init, jax.random.key(0), X, mesh=eight)
    unboxed = nn.unbox(params)
    workdir = tempfile.TemporaryDirectory()
    path = workdir.name + "/ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, unboxed)
    pod = MESHES["explicit"]()
    with jts.axis_rules(RULES):
        target = jts.abstract(Mlp().init, jax.random.key(0), X, mesh=pod)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, nn.unbox(target))
        assert jts.check_tree(restored, target, summary=True).checked == 2
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(_replicate(restored, pod), target, name="restored")
    workdir.cleanup()
    kernel = restored["params"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")
    assert "restored['params']['Dense_1']['kernel']:" in str(info.value)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Holder:
    w: Float[Array, "embed mlp", jts.Logical]


def test_field_annotation_beside_a_box(mesh):
    params = _params(mesh)
    box = params["params"]["Dense_0"]["kernel"]
    with jts.axis_rules(RULES):
        assert jts.check_tree(Holder(box), summary=True).checked == 1
        other = nn.LogicallyPartitioned(box.value, ("mlp", "embed"))
        with pytest.raises(jts.ShardingAnnotationError) as info:
            jts.check_tree(Holder(other))
    text = str(info.value)
    assert "tree.w" in text and "disagree" in text
    assert "names=('mlp', 'embed')" in text


def test_caller_annotations_and_rules_win_over_boxes(mesh):
    params = _params(mesh)
    with jts.axis_rules(RULES):
        # A path rule speaks for the leaves it matches, as for NNX metadata.
        got = jts.shardings(params, mesh, rules={"**/Dense_1/kernel/value": P()})
        assert got["params"]["Dense_1"]["kernel"].value.spec == P(None, None)
        assert got["params"]["Dense_0"]["kernel"].value.spec == P("data", "model")
        with pytest.raises(jts.ShardingTypeCheckError, match=r"Dense_0"):
            jts.check_tree(params, rules={"**/Dense_0/kernel/value": P()})


def test_like_a_boxed_tree_for_unboxed_states(mesh):
    optax = pytest.importorskip("optax")
    params = _params(mesh)
    plain = nn.unbox(params)
    with jax.set_mesh(mesh):
        state = optax.adam(1e-3).init(plain)
    with jts.axis_rules(RULES):
        summary = jts.check_tree(state, like=params, summary=True)
        assert summary.checked == summary.leaves == 5  # the count: replicated
        specs = jts.shardings(plain, mesh, like=params)
        assert specs["params"]["Dense_0"]["kernel"].spec == P("data", "model")
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(_replicate(state, mesh), like=params, name="opt_state")
    text = str(info.value)
    assert "opt_state[0].mu['params']['Dense_1']['kernel']:" in text
    assert "opt_state[0].nu['params']['Dense_1']['kernel']:" in text
    assert "Dense_0" not in text
