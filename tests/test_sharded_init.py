"""`jts.sharded_init` and `jts.abstract`: modules created where they will live."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._drivers.init import sharded_init as _init

from .helpers import MESHES


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


@jaxtyped(typechecker=beartype)
class Dense(eqx.Module):
    # The generated __init__: jaxtyping checks its parameters, the fields.
    weight: Float[Array, "embed mlp", P("data", "model")]
    bias: Float[Array, "mlp", P("model")]  # noqa: F821
    scale: float
    name: str = eqx.field(static=True, default="dense")


def Linear(key, embed=16, mlp=8):
    weight = jax.random.normal(key, (embed, mlp))
    return Dense(weight, jnp.arange(mlp, dtype=jnp.float32), 0.5)


@jaxtyped(typechecker=beartype)
class CustomInit(eqx.Module):
    # A custom __init__: jaxtyping does not check the fields it sets, so
    # sharded_init's verification of the result is their check.
    weight: Float[Array, "embed mlp", P("data", "model")]

    def __init__(self, key):
        self.weight = jax.random.normal(key, (16, 8))


def _spec_is(x, spec):
    ndim = len(x.shape)
    return x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), ndim)


def _reference(fn, *args):
    with jts.set_mode("off"):
        return fn(*args)


def test_module_created_sharded_with_checks_on(mesh):
    key = jax.random.key(0)
    layer = jts.sharded_init(Linear, key, mesh=mesh)
    assert _spec_is(layer.weight, P("data", "model"))
    assert _spec_is(layer.bias, P("model"))
    assert layer.weight.sharding.mesh == mesh
    assert layer.scale == 0.5 and layer.name == "dense"  # non-arrays pass through
    want = _reference(Linear, key)
    np.testing.assert_array_equal(np.asarray(layer.weight), np.asarray(want.weight))
    np.testing.assert_array_equal(np.asarray(layer.bias), np.asarray(want.bias))
    assert isinstance(layer.weight, Float[Array, "e m", P("data", "model")])


def test_context_mesh_and_keyword_arguments():
    mesh = MESHES["explicit"]()
    with jax.set_mesh(mesh):
        layer = jts.sharded_init(Linear, jax.random.key(1), embed=8, mlp=4)
    assert layer.weight.shape == (8, 4) and _spec_is(layer.weight, P("data", "model"))
    with pytest.raises(ValueError, match="needs a mesh"):
        jts.sharded_init(Linear, jax.random.key(1))


def test_eval_shape_false_alarm_that_abstract_avoids():
    # The problem sharded_init solves: with checks on, the module's own __init__
    # sees unplaced tracers on an Explicit mesh.
    mesh = MESHES["explicit"]()
    with jax.set_mesh(mesh), pytest.raises(jaxtyping.TypeCheckError):
        jax.eval_shape(Linear, jax.random.key(0))
    tree = jts.abstract(Linear, jax.random.key(0), mesh=mesh)
    assert tree.weight.sharding == NamedSharding(mesh, P("data", "model"))
    assert tree.name == "dense" and tree.scale == 0.5


def test_abstract_reports_shardings_on_auto_meshes():
    mesh = MESHES["auto"]()
    with jax.set_mesh(mesh):
        plain = jax.eval_shape(Linear, jax.random.key(0))
    assert plain.weight.sharding is None or plain.weight.sharding.spec != P(
        "data", "model"
    )  # jax#19656: eval_shape reports none on Auto meshes
    tree = jts.abstract(Linear, jax.random.key(0), mesh=mesh)
    assert isinstance(tree.weight, jax.ShapeDtypeStruct)
    assert _spec_is(tree.weight, P("data", "model"))
    assert tree.bias.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1)


@jaxtyped(typechecker=beartype)
def _rows(w: Float[Array, "a b", P("model", None)]) -> Float[Array, "a b"]:
    return w * 2


def Mislabelled(key):
    # The helper's hint contradicts the field's layout: XLA lays out the product as
    # the field (the output), so the helper's check must fail, not be skipped.
    return Dense(_rows(jax.random.normal(key, (16, 8))), jnp.zeros(8), 1.0)


def test_custom_init_fields_verified_on_the_output(mesh):
    out = jts.sharded_init(CustomInit, jax.random.key(0), mesh=mesh)
    assert _spec_is(out.weight, P("data", "model"))
    tree = jts.abstract(CustomInit, jax.random.key(0), mesh=mesh)
    assert _spec_is(tree.weight, P("data", "model"))


def test_checks_inside_init_run_and_fail(mesh):
    match = "while compiling `sharded_init_Mislabelled`: argument `w` of `_rows`"
    with pytest.raises(jts.ShardingTypeCheckError, match=match):
        jts.sharded_init(Mislabelled, jax.random.key(0), mesh=mesh)


def test_checks_inside_init_warn_and_off():
    mesh = MESHES["auto"]()
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
        out = jts.sharded_init(Mislabelled, jax.random.key(0), mesh=mesh)
    assert _spec_is(out.weight, P("data", "model"))
    with jts.set_mode("off"):
        out = jts.sharded_init(Mislabelled, jax.random.key(0), mesh=mesh)
    assert _spec_is(out.weight, P("data", "model"))


Cols = Float[Array, "a b", P(None, "model")]
Plain = Float[Array, "a b"]


@jaxtyped(typechecker=None)
@typechecked
def _cols(w: Cols) -> Plain:
    return w * 1.0


def test_typeguard_form_inside_a_function(mesh):
    def init(key):
        return {"w": _cols(jax.random.normal(key, (8, 4)))}

    ann = {"w": P(None, "model")}
    out = jts.sharded_init(init, jax.random.key(0), mesh=mesh, annotations=ann)
    assert _spec_is(out["w"], P(None, "model"))
    bad = {"w": P("data", None)}
    with pytest.raises(jts.ShardingTypeCheckError):
        jts.sharded_init(init, jax.random.key(0), mesh=mesh, annotations=bad)


def test_annotations_and_rules_for_third_party_modules():
    mesh = MESHES["explicit"]()
    make = lambda key: eqx.nn.Linear(16, 8, key=key)  # noqa: E731
    rules = {"weight": P("model", None), "bias": P("model")}
    layer = jts.sharded_init(make, jax.random.key(0), mesh=mesh, rules=rules)
    assert _spec_is(layer.weight, P("model", None)) and _spec_is(layer.bias, P("model"))
    ann = eqx.nn.Linear(16, 8, key=jax.random.key(0))
    ann = jax.tree.map(lambda _: None, ann)
    ann = eqx.tree_at(
        lambda m: m.weight, ann, P(None, "data"), is_leaf=lambda x: x is None
    )
    layer = jts.sharded_init(make, jax.random.key(0), mesh=mesh, annotations=ann)
    assert _spec_is(layer.weight, P(None, "data")) and _spec_is(layer.bias, P())


def test_unannotated_leaves_replicated_or_refused_when_strict():
    mesh = MESHES["explicit"]()

    def init():
        return {"w": jnp.ones((8, 4)), "step": jnp.zeros((), jnp.int32), "lr": 0.1}

    ann = {"w": P("data"), "step": None, "lr": None}
    out = jts.sharded_init(init, mesh=mesh, annotations=ann)
    assert _spec_is(out["w"], P("data")) and _spec_is(out["step"], P())
    assert out["step"].sharding.mesh == mesh and out["lr"] == 0.1
    with pytest.raises(jts.ShardingAnnotationError, match=r"output\['step'\]"):
        jts.sharded_init(init, mesh=mesh, annotations=ann, strict=True)


def test_every_bad_leaf_reported_before_compiling(monkeypatch, mesh):
    traces = []

    def init():
        traces.append(1)
        return {
            "vocab": jnp.zeros((50257, 8)),
            "ok": jnp.zeros((8, 8)),
            "both": jnp.zeros((6, 8)),
            "typo": jnp.zeros((8, 8)),
        }

    ann = {
        "vocab": P("data", None),
        "ok": P("data", "model"),
        "both": P(("data", "model"), None),
        "typo": P("dta", None),
    }
    monkeypatch.setattr(_init.jax, "jit", None)  # compiling would fail loudly
    with pytest.raises(jts.ShardingAnnotationError) as info:
        jts.sharded_init(init, mesh=mesh, annotations=ann)
    text = str(info.value)
    assert "3 leaf/leaves" in text
    assert "output['vocab']" in text and "(50260, 8)" in text
    assert "dim 0 (50257) is not divisible by data=4" in text
    assert "output['both']" in text and "(8, 8)" in text and "(data,model)=8" in text
    assert "output['typo']" in text and "'dta'" in text
    assert "output['ok']" not in text
    assert len(traces) == 1  # the abstract trace only


def test_structured_init_upper_triangular(mesh):
    def init(key):
        return {"w": jnp.triu(jax.random.normal(key, (16, 16)))}

    ann = {"w": P("data", "model")}
    out = jts.sharded_init(init, jax.random.key(3), mesh=mesh, annotations=ann)
    w = np.asarray(out["w"])
    assert _spec_is(out["w"], P("data", "model"))
    np.testing.assert_array_equal(w, np.asarray(init(jax.random.key(3))["w"]))
    assert np.all(np.tril(w, -1) == 0) and np.all(np.diag(w) != 0)


def test_cache_sequence_meshes_and_modes():
    # The same function, called again after the mesh or the mode changed: each
    # result follows the call's own mesh, and the checks follow the mode.
    key = jax.random.key(0)
    seen = []
    for kind in ("explicit", "auto", "mixed", "explicit"):
        mesh = MESHES[kind]()
        layer = jts.sharded_init(Linear, key, mesh=mesh)
        assert layer.weight.sharding.mesh == mesh
        seen.append(tuple(layer.weight.sharding.mesh.axis_types))
    assert seen[0] == seen[3] != seen[1]
    other = Mesh(
        np.asarray(jax.devices()[:8]).reshape(2, 4),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    layer = jts.sharded_init(Linear, key, mesh=other)
    assert _spec_is(layer.weight, P("data", "model"))
    assert layer.weight.addressable_shards[0].data.shape == (8, 2)
    mesh = MESHES["auto"]()
    with pytest.raises(jts.ShardingTypeCheckError):
        jts.sharded_init(Mislabelled, key, mesh=mesh)
    with jts.set_mode("off"):
        jts.sharded_init(Mislabelled, key, mesh=mesh)
    with pytest.raises(jts.ShardingTypeCheckError):
        jts.sharded_init(Mislabelled, key, mesh=mesh)


@dataclasses.dataclass
class _Tree:
    leaves: list


def test_verify_names_the_leaf_without_moving_data():
    mesh = MESHES["explicit"]()
    good = NamedSharding(mesh, P("data", None))
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P(None, "model")))
    tree = {"a": {"w": x}}
    with jax.transfer_guard("disallow"):
        _init.verify(tree, [NamedSharding(mesh, P(None, "model"))], "sharded_init")
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            _init.verify(tree, [good], "sharded_init")
        assert "output['a']['w']: `float32[8,4@model]`, not `float32[8@data,4]`" in str(
            info.value
        )
        with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning, match="output"):
            _init.verify(tree, [good], "sharded_init")
        with jts.set_mode("off"):
            _init.verify(tree, [good], "sharded_init")


@jaxtyped(typechecker=beartype)
class LogicalDense(eqx.Module):
    w: Float[Array, "embed mlp", jts.Logical]


def test_logical_annotations_follow_the_rules_in_force():
    mesh = MESHES["explicit"]()
    make = lambda key: LogicalDense(jax.random.normal(key, (16, 8)))  # noqa: E731
    key = jax.random.key(0)
    with jts.axis_rules({"embed": "data", "mlp": "model"}):
        out = jts.sharded_init(make, key, mesh=mesh)
        tree = jts.abstract(make, key, mesh=mesh)
    assert _spec_is(out.w, P("data", "model")) and _spec_is(tree.w, P("data", "model"))
    with jts.axis_rules({"embed": None, "mlp": "data"}):
        out = jts.sharded_init(make, key, mesh=mesh)
    assert _spec_is(out.w, P(None, "data"))


def test_checks_of_returned_values_run_on_the_result(mesh):
    # `annotations=` overrides the field's layout, so Dense.__init__'s own check of
    # `weight` (deferred to the result) must fail, with the leaf's key path.
    ann = {"weight": P(None, "model"), "bias": None, "scale": None}
    key = jax.random.key(0)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.sharded_init(Linear, key, mesh=mesh, annotations=ann)
    text = str(info.value)
    assert "argument `weight` of `Dense.__init__`" in text, text
    assert "created as output.weight" in text and "float32[16,8@model]" in text, text
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning, match="output.weight"):
        out = jts.sharded_init(Linear, key, mesh=mesh, annotations=ann)
    assert _spec_is(out.weight, P(None, "model"))


def test_explain_shows_the_result():
    mesh = MESHES["explicit"]()
    layer = jts.sharded_init(Linear, jax.random.key(0), mesh=mesh)
    table = jts.explain(layer, mesh)
    rows = {row.path: row for row in table.rows}
    weight = next(r for p, r in rows.items() if "weight" in p)
    assert tuple(weight.shard_shape) == layer.weight.addressable_shards[0].data.shape
    assert weight.bytes_per_device == 16 * 8 * 4 // 8
    assert "weight" in str(table) and "bias" in str(table)
