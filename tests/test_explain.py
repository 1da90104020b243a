"""`jts.explain`: the table of what annotations mean on a mesh."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Float32
from jaxtyping_shard.pytest_plugin import make_mesh


@pytest.fixture
def mesh():
    return make_mesh((4, 2), ("fsdp", "tensor"), "explicit")


FSDP = jts.AxisRules({"embed": "fsdp", "mlp": None}, conflicts="first")
TP = jts.AxisRules({"embed": None, "mlp": "tensor"})

PARAMS = {
    "w_in": jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
    "w_sq": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
    "step": jax.ShapeDtypeStruct((), jnp.int32),
}
ANNOTATIONS = {
    "w_in": Float[Array, "embed mlp", jts.Logical],
    "w_sq": Float[Array, "embed embed", jts.Logical],
    "step": None,
}
MiB = 1024 * 1024


def test_rows_follow_the_rules_in_force(mesh):
    with jts.axis_rules(FSDP):
        fsdp = jts.explain(PARAMS, mesh, annotations=ANNOTATIONS)
    with jts.axis_rules(TP):
        tp = jts.explain(PARAMS, mesh, annotations=ANNOTATIONS)
    rows = {r.path: r for r in fsdp.rows}
    assert rows["['w_in']"].spec == P("fsdp", None)
    assert rows["['w_in']"].logical == ("embed", "mlp")
    assert rows["['w_in']"].shard_shape == (256, 4096)
    assert rows["['w_in']"].bytes_per_device == 4 * MiB
    # Sharded 4 ways, replicated over the 2 tensor devices: 8 * 4 MiB - 16 MiB.
    assert rows["['w_in']"].bytes_replicated == 16 * MiB
    assert rows["['w_sq']"].spec == P("fsdp", None)  # conflicts="first"
    assert rows["['w_sq']"].bytes_per_device == 512 * 1024
    assert rows["['step']"].spec is None
    assert fsdp.bytes_per_device == 4 * MiB + 512 * 1024
    rows = {r.path: r for r in tp.rows}
    assert rows["['w_in']"].spec == P(None, "tensor")
    assert rows["['w_in']"].shard_shape == (1024, 2048)
    assert rows["['w_sq']"].spec == P(None, None)
    assert rows["['w_sq']"].bytes_replicated == 7 * 2 * MiB  # 7 extra copies


def test_table_text(mesh):
    with jts.axis_rules(FSDP):
        text = str(jts.explain(PARAMS, mesh, annotations=ANNOTATIONS))
    lines = text.splitlines()
    assert lines[0] == (
        "mesh ('fsdp': 4, 'tensor': 2); axis rules {'embed': 'fsdp', 'mlp': None} "
        "(conflicts='first')"
    )
    assert lines[1].split() == [
        "path", "dims", "logical", "mesh", "axes", "shard/device", "bytes/device",
        "bytes", "replicated",
    ]  # fmt: skip
    w_in = next(line for line in lines if line.startswith("['w_in']"))
    assert w_in.split() == [
        "['w_in']", "embed", "mlp", "embed", "mlp", "float32[1024@fsdp,4096]",
        "256x4096", "4.0", "MiB", "16.0", "MiB",
    ]  # fmt: skip
    step = next(line for line in lines if line.startswith("['step']"))
    assert "not annotated" in step
    assert lines[-1].split() == ["total", "4.5", "MiB", "18.0", "MiB"]


def test_one_annotation_with_and_without_sizes(mesh):
    A = Float32[Array, "embed mlp", jts.Logical]
    with jts.axis_rules(TP):
        (row,) = jts.explain(A, mesh, sizes={"embed": 8, "mlp": 6}).rows
        assert row.shape == (8, 6) and row.shard_shape == (8, 3)
        assert row.bytes_per_device == 8 * 3 * 4
        (row,) = jts.explain(A, mesh).rows
        assert row.spec == P(None, "tensor") and row.shard_shape is None
        assert "?" in str(jts.explain(A, mesh))
        (row,) = jts.explain(A).rows  # no mesh at all: the spec only
        assert row.spec == P(None, "tensor") and row.bytes_per_device is None
        with jax.set_mesh(mesh):  # the context mesh
            (row,) = jts.explain(A, sizes={"embed": 8, "mlp": 6}).rows
        assert row.shard_shape == (8, 3)


def test_uneven_shards_round_up(mesh):
    with jts.axis_rules({"embed": "fsdp", "mlp": None}):
        (row,) = jts.explain(
            Float32[Array, "embed mlp", jts.Logical], mesh, sizes={"embed": 6, "mlp": 2}
        ).rows
    assert row.shard_shape == (2, 2)


def test_physical_annotations_and_specs(mesh):
    tree = {
        "a": Float[Array, "batch@fsdp embed"],
        "b": P("fsdp", "tensor"),
        "c": Float[Array, "batch embed", P(None, "tensor")],
    }
    rows = {r.path: r for r in jts.explain(tree, mesh).rows}
    assert rows["['a']"].spec == P("fsdp", None) and rows["['a']"].logical is None
    assert rows["['b']"].spec == P("fsdp", "tensor")
    assert rows["['c']"].spec == P(None, "tensor")


def test_fields_and_concrete_arrays(mesh):
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Mlp:
        w_in: Float[Array, "embed mlp", jts.Logical]
        w_out: Float[Array, "mlp embed", jts.Logical]

    model = Mlp(jnp.zeros((8, 4)), jnp.zeros((4, 8)))
    with jts.axis_rules(TP):
        rows = jts.explain(model, mesh).rows
    assert [(r.path, r.spec) for r in rows] == [
        (".w_in", P(None, "tensor")),
        (".w_out", P("tensor", None)),
    ]
    assert rows[0].bytes_per_device == 8 * 2 * 4


def test_resolution_errors_name_the_leaf(mesh):
    with jts.axis_rules({"embed": "fsdp"}):
        with pytest.raises(
            jts.ShardingAnnotationError,
            match=r"tree\['w_in'\]: .*: no axis rule for logical name 'mlp'",
        ):
            jts.explain(PARAMS, mesh, annotations=ANNOTATIONS)
        with pytest.raises(jts.ShardingAnnotationError, match=r"both resolve"):
            jts.explain(ANNOTATIONS["w_sq"], mesh)
    with jts.axis_rules({"embed": "data", "mlp": None}):
        with pytest.raises(jts.ShardingAnnotationError, match=r"no such axis"):
            jts.explain(ANNOTATIONS["w_in"], mesh)


class Block(eqx.Module):
    w: Float[Array, "embed mlp", P(None, "tensor")]
    b: Float[Array, "mlp", jts.Logical]  # noqa: F821


class Stack(eqx.Module):
    blocks: Block

    def __init__(self, key):
        make = lambda k: Block(jax.random.normal(k, (8, 4)), jnp.zeros(4))
        self.blocks = eqx.filter_vmap(make)(jax.random.split(key, 4))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("lead", [1, ("fsdp",)])
def test_stacked_shows_the_result_of_a_stacked_init(kind, lead):
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), kind)
    stacked = {"blocks/**": lead}
    with jts.axis_rules({"mlp": "tensor"}):
        stack = jts.sharded_init(Stack, jax.random.key(0), mesh=mesh, stacked=stacked)
        report = jts.explain(stack, mesh, stacked=stacked)
    first = None if lead == 1 else "fsdp"
    want = {".blocks.w": P(first, None, "tensor"), ".blocks.b": P(first, "tensor")}
    assert {r.path: r.spec for r in report.rows} == want
    for row, leaf in zip(report.rows, (stack.blocks.w, stack.blocks.b)):
        # The table says what each device really holds.
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, row.spec), leaf.ndim)
        assert row.shard_shape == leaf.addressable_shards[0].data.shape
        assert row.bytes_per_device == leaf.addressable_shards[0].data.nbytes
    assert report.rows[1].logical == (None, "mlp")
    assert report.rows[0].dims == "[stack] embed mlp"
    assert "[stack] embed mlp" in str(report)


def test_a_stack_is_declared_not_guessed(mesh):
    with jts.axis_rules({"mlp": "tensor"}):
        stack = jts.sharded_init(
            Stack, jax.random.key(0), mesh=mesh, stacked={"blocks/**": 1}
        )
        # Undeclared, the extra dim would shift every spec entry: an error.
        with pytest.raises(jts.ShardingAnnotationError) as info:
            jts.explain(stack, mesh)
        assert "tree.blocks.w: " in str(info.value)
        assert "has 2 dims, but the array of shape (4, 8, 4) has 3" in str(info.value)
        assert "stacked={'blocks/w': 1}" in str(info.value)
        with pytest.raises(jts.ShardingAnnotationError, match="matches no leaf"):
            jts.explain(stack, mesh, stacked={"layers/**": 1})
        with pytest.raises(jts.ShardingAnnotationError, match="has 0 after its 3 st"):
            jts.explain(stack, mesh, stacked={"blocks/**": 3})
        with pytest.raises(jts.ShardingAnnotationError, match="rank 3, fewer dims"):
            jts.explain(stack, mesh, stacked={"blocks/**": 4})
        with pytest.raises(jts.ShardingAnnotationError, match="at least one dim"):
            jts.explain(stack, mesh, stacked={"blocks/**": 0})
        with pytest.raises(jts.ShardingAnnotationError, match="'pipe'.*lacks"):
            jts.explain(stack, mesh, stacked={"blocks/**": ("pipe",)})
        with pytest.raises(jts.ShardingAnnotationError, match="give the tree"):
            jts.explain(Block.__annotations__["w"], mesh, stacked={"w": 1})


def test_stacked_annotations_without_values(mesh):
    tree = {"w": Float32[Array, "embed mlp", P(None, "tensor")]}
    (row,) = jts.explain(
        tree, mesh, sizes={"embed": 8, "mlp": 4}, stacked={"w": ("fsdp",)}
    ).rows
    assert row.spec == P("fsdp", None, "tensor")
    assert row.shape is None and row.shard_shape is None  # the stack's size unknown


def test_a_missing_mesh_axis_is_an_annotation_error(mesh):
    tree = {"a": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with pytest.raises(jts.ShardingAnnotationError, match=r"tree\['a'\].*'data'"):
        jts.explain(tree, mesh, annotations={"a": P("data")})
