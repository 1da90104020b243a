"""Never silent about layout metadata it cannot read (issue 34, item 2): a leaf
whose Flax metadata (a Linen box, an NNX Variable) is of a form known but not
resolvable is named by key path in the error, never counted as checked, never
passed over; metadata that declares no layout is not refused."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES


nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
bridge = pytest.importorskip("flax.nnx.bridge.variables")

RULES = {"embed": "data", "mlp": "model"}


class Mine(nn.LogicallyPartitioned):
    """A subclass of a Linen box: its reading of `names` may be its own."""


def _x(mesh, spec=P("data", "model")):
    return jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, spec))


def _cases(mesh):
    x = _x(mesh)
    with nnx.use_eager_sharding(False):
        bad_nnx = nnx.Param(x, out_sharding=("embed", 3))
    return {
        "short names": (nn.LogicallyPartitioned(x, ("embed",)), "1 names"),
        "long names": (nn.Partitioned(x, ("data", "model", None)), "3 names"),
        "not a string": (nn.LogicallyPartitioned(x, ("embed", 3)), "the name 3"),
        "not a mesh axis": (nn.Partitioned(x, (("data", 3), None)), "('data', 3)"),
        "subclass": (Mine(x, ("embed", "mlp")), "a subclass of a Linen box"),
        "bridge metadata": (
            bridge.NNXMeta(nnx.Param, x, {"out_sharding": ("embed", "mlp")}),
            "kind of Flax axis metadata not read",
        ),
        "nnx names": (bad_nnx, "3 is not an axis name"),
    }


CASE_NAMES = [
    "short names",
    "long names",
    "not a string",
    "not a mesh axis",
    "subclass",
    "bridge metadata",
    "nnx names",
]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@pytest.mark.parametrize("case", CASE_NAMES)
def test_named_by_path_in_check_tree_and_shardings(mesh, case):
    box, why = _cases(mesh)[case]
    good = nn.LogicallyPartitioned(_x(mesh), ("embed", "mlp"))
    tree = {"layer": {"good": good, "bad": box}}
    with jts.axis_rules(RULES):
        for call in (
            lambda: jts.check_tree(tree, name="params"),
            lambda: jts.check_tree(tree, summary=True, may_check_nothing=True),
            lambda: jts.shardings(tree, mesh),
            lambda: jts.explain(tree, mesh=mesh),
        ):
            with pytest.raises(jts.ShardingAnnotationError) as info:
                call()
            text = str(info.value)
            assert "['layer']['bad']" in text, text
            assert why in text, text
            assert "['good']" not in text


@pytest.mark.parametrize("case", CASE_NAMES[:5])
def test_named_in_an_annotation_tree(mesh, case):
    box, why = _cases(mesh)[case]
    unboxed = {"layer": {"bad": _x(mesh)}}
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.check_tree(unboxed, annotations={"layer": {"bad": box}})
    assert "annotations['layer']['bad']" in str(info.value)
    assert why in str(info.value)


def test_named_at_the_jit_boundary(mesh):
    box, why = _cases(mesh)["short names"]

    @jts.jit
    def step(params):
        return params

    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        with pytest.raises(jts.ShardingAnnotationError) as info:
            step({"w": box})
    assert "['w']" in str(info.value) and why in str(info.value)


def test_metadata_without_layout_is_not_refused(mesh):
    # The bridge's metadata with no sharding declares nothing: the leaf is
    # unannotated, counted as such (not refused, not a pass).
    plain = bridge.NNXMeta(nnx.Param, _x(mesh), {})
    good = nn.LogicallyPartitioned(_x(mesh), ("embed", "mlp"))
    with jts.axis_rules(RULES):
        summary = jts.check_tree({"a": plain, "b": good}, summary=True)
    assert summary.checked == 1 and summary.leaves == 2
    assert summary.unannotated == ("tree['a'].value",)


def test_unreadable_nnx_metadata_object_is_named(mesh):
    class Odd(nnx.Param):
        def get_metadata(self):
            raise RuntimeError("no metadata here")

    with nnx.use_eager_sharding(False):
        odd = Odd(_x(mesh))
    with jts.axis_rules(RULES), pytest.raises(jts.ShardingAnnotationError) as info:
        jts.check_tree({"odd": odd})
    assert "model['odd']" in str(info.value)
    assert "metadata cannot be read" in str(info.value)
