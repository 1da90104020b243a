"""Flax's eager sharding (`nnx.use_eager_sharding`) and `jts.axis_rules`: one
table for both through `jts.flax_rules()`; checked with it on and off."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES


nnx = pytest.importorskip("flax.nnx")

RULES = {"embed": "data", "mlp": "model"}
SWAPPED = {"embed": "model", "mlp": "data"}


class Mlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (8, 16)))
        self.b = nnx.Param(jnp.zeros((16,)), out_sharding=("mlp",))


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


def _mixed(mesh):
    return len(set(mesh.axis_types)) > 1


def _is(x, mesh, spec):
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


@pytest.mark.parametrize("eager", [True, False])
def test_one_table_for_flax_and_jts(mesh, eager):
    with jts.axis_rules(RULES), nnx.logical_axis_rules(jts.flax_rules()):
        with jax.set_mesh(mesh), nnx.use_eager_sharding(eager):
            if eager and _mixed(mesh):
                # Flax's eager sharding refuses a mesh of mixed axis types.
                with pytest.raises(ValueError, match="mixed axis types"):
                    Mlp(nnx.Rngs(0))
                return
            model = Mlp(nnx.Rngs(0))
            if eager:  # Flax placed it, by the same table: the checks pass
                assert _is(model.w.get_value(), mesh, P("data", "model"))
                jts.check_tree(model)
            else:  # created on one device: the checks say where
                with pytest.raises(jts.ShardingTypeCheckError, match=r"\.w\.value"):
                    jts.check_tree(model, name="model")
            # sharded_init places it either way (Flax's own sharding inside).
            placed = jts.sharded_init(lambda: Mlp(nnx.Rngs(0)), mesh=mesh)
            assert _is(placed.w.get_value(), mesh, P("data", "model"))
            jts.check_tree(placed)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_two_tables_that_differ_are_caught(kind):
    """Flax placing by one table and jts checking by another: every Param whose
    layout differs is named."""
    mesh = MESHES[kind]()
    with jts.axis_rules(SWAPPED), nnx.logical_axis_rules(jts.flax_rules(RULES)):
        with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
            model = Mlp(nnx.Rngs(0))
            with pytest.raises(jts.ShardingTypeCheckError) as info:
                jts.check_tree(model, name="model")
    text = str(info.value)
    assert "model.w.value" in text and "model.b.value" in text
    assert "2 of 2 checked leaves" in text


def test_flax_rules_forms():
    assert jts.flax_rules({"a": "x", "b": ("x", "y"), "c": None}) == (
        ("a", "x"),
        ("b", ("x", "y")),
        ("c", None),
    )
    assert jts.flax_rules([("a", "x"), ("b", None)]) == (("a", "x"), ("b", None))
    with jts.axis_rules({"a": "x"}):
        assert jts.flax_rules() == (("a", "x"),)
    with pytest.raises(jts.ShardingAnnotationError, match="no axis rules in force"):
        jts.flax_rules()
    with pytest.raises(jts.ShardingAnnotationError, match="'a' have fallbacks"):
        jts.flax_rules({"a": ["x", None]})
    with pytest.raises(jts.ShardingAnnotationError, match="conflicts='first'"):
        jts.flax_rules(jts.AxisRules({"a": "x"}, conflicts="first"))
