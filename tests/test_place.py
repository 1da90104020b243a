"""`place`, `place_for`, `local_rows` on one process (8 CPU devices).

The two-process job (batch over `data` across processes) is in
`test_multihost_place.py`; on one process the local data is the whole array and
every call must mean the same.
"""

import dataclasses

import jax
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int, Shaped
from jaxtyping_shard._drivers.place import rows as _rows, verify as _verify


Tokens = Int[Array, "batch seq", P("data", None)]
Flat = Int[Array, "batch seq", P(("data", "model"), None)]
Inline = Int[Array, "batch@data seq"]
Lengths = Int[Array, "batch@data"]
Weights = Float[Array, "batch@data"]
Table = Float[Array, "v", P()]


def _mesh(kind):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return _mesh(request.param)


def _tokens(rows=16, cols=8):
    return np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)


@pytest.mark.parametrize(
    "annotation, spec",
    [
        (Tokens, P("data", None)),
        (Inline, P("data", None)),
        (Flat, P(("data", "model"), None)),
        (P(None, "model"), P(None, "model")),
        (Int[Array, "b s", P()], P()),
    ],
)
def test_place_one_array(mesh, annotation, spec):
    local = _tokens()
    x = jts.place(local, annotation, mesh, verify="checksum")
    assert x.shape == local.shape and x.dtype == local.dtype
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert x.sharding.mesh is mesh
    np.testing.assert_array_equal(np.asarray(x), local)
    if isinstance(annotation, type):
        assert isinstance(x, annotation)


def test_place_matches_hand_written(mesh):
    local = _tokens()
    sharding = NamedSharding(mesh, P("data", None))
    ours = jts.place(local, Tokens, mesh)
    theirs = jax.make_array_from_process_local_data(sharding, local)
    assert ours.sharding == theirs.sharding
    for a, b in zip(ours.addressable_shards, theirs.addressable_shards):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_place_uses_context_mesh_and_named_sharding():
    explicit, auto = _mesh(AxisType.Explicit), _mesh(AxisType.Auto)
    with jax.set_mesh(explicit):
        x = jts.place(_tokens(), Tokens)
        # A NamedSharding annotation keeps its own mesh, whatever the context.
        y = jts.place(_tokens(), NamedSharding(auto, P("model")))
    assert x.sharding.mesh is explicit
    assert y.sharding.mesh is auto and y.sharding.spec == P("model")
    with jax.set_mesh(auto):  # the same call, warm, under another context mesh
        assert jts.place(_tokens(), Tokens).sharding.mesh is auto
    other = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(other):
        z = jts.place(_tokens(), Tokens)
    assert z.sharding.mesh is other
    assert z.sharding.shard_shape((16, 8)) == (8, 8)
    with pytest.raises(ValueError, match="needs a mesh"):
        jts.place(_tokens(), Tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    tokens: Int[Array, "batch seq", P("data", None)]
    weights: Weights
    table: Table


def test_place_tree_by_fields_hint_and_annotation_tree(mesh):
    local = Batch(_tokens(), np.ones(16, np.float32), np.zeros(3, np.float32))
    placed = jts.place(local, None, mesh)  # the dataclass's own fields
    assert placed.tokens.sharding.spec == P("data", None)
    assert placed.weights.sharding.spec == P("data")
    assert placed.table.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
    as_dict = {"tokens": _tokens(), "mask": np.ones((16, 8), np.bool_)}
    by_tree = jts.place(as_dict, {"tokens": Tokens, "mask": P("data")}, mesh)
    by_hint = jts.place(as_dict, dict[str, Shaped[Array, "b s", P("data")]], mesh)
    assert by_tree["mask"].sharding.spec == P("data", None)
    assert by_hint["tokens"].sharding.spec == P("data", None)
    np.testing.assert_array_equal(np.asarray(by_tree["mask"]), as_dict["mask"])


def test_place_replicates_a_leaf_without_sharding_and_strict_refuses_it(mesh):
    # As sharded_init: a leaf that declares no sharding (here an annotation with
    # none; an optax state's `count` in tests/test_third_party_hints.py) is
    # placed replicated; strict=True makes it an error naming the leaf.
    local = {"tokens": _tokens(), "mask": np.ones(3)}
    given = {"tokens": Tokens, "mask": Float[Array, "n"]}
    placed = jts.place(local, given, mesh)
    assert placed["mask"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
    assert placed["tokens"].sharding.spec == P("data", None)
    with pytest.raises(jts.ShardingAnnotationError, match=r"local\['mask'\] has no"):
        jts.place(local, given, mesh, strict=True)


def test_local_size_errors_name_size_and_axes(mesh):
    with pytest.raises(jts.PlacementError) as info:
        jts.place(_tokens(rows=6), Flat, mesh)
    text = str(info.value)
    assert "dim 0 of the local data has 6 elements, not a multiple of 8" in text
    assert "'data' (4) x 'model' (2) into 8 shards" in text
    with pytest.raises(jts.PlacementError, match="cannot split evenly into 4"):
        jts.place(_tokens(rows=6), Tokens, mesh, global_shape=(6, 8))
    with pytest.raises(jts.PlacementError, match="has 4 elements, expected 16"):
        jts.place(_tokens(rows=4), Tokens, mesh, global_shape=(16, 8))
    with pytest.raises(jts.PlacementError, match="global_shape .* has 1 dims"):
        jts.place(_tokens(), Tokens, mesh, global_shape=(16,))


def test_annotation_errors_before_building(mesh):
    with pytest.raises(jts.ShardingAnnotationError, match="names mesh axis 'fsdp'"):
        jts.place(_tokens(), Int[Array, "b s", P("fsdp", None)], mesh)
    with pytest.raises(jts.ShardingAnnotationError, match="has 2 dims, but ndim=3"):
        jts.place(np.zeros((16, 8, 2), np.int32), Tokens, mesh)
    with pytest.raises(ValueError, match="verify must be"):
        jts.place(_tokens(), Tokens, mesh, verify="all")


def test_global_shape_override(mesh):
    local = _tokens()
    x = jts.place(local, Tokens, mesh, global_shape=(16, 8))
    assert x.shape == (16, 8)
    tree = jts.place(
        {"a": local, "b": local}, Tokens, mesh, global_shape={"a": None, "b": (16, 8)}
    )
    assert tree["a"].shape == tree["b"].shape == (16, 8)
    with pytest.raises(jts.PlacementError, match="gives 3 shapes for 2 arrays"):
        jts.place({"a": local, "b": local}, Tokens, mesh, global_shape=[(16, 8)] * 3)


@jaxtyped(typechecker=beartype)
def train_step(
    batch: Int[Array, "batch seq", P("data", None)],
    lengths: Lengths,
    scale: float,
) -> Int[Array, ""]:
    return batch.sum() + lengths.sum()


def test_place_for_reads_the_consumer(mesh):
    batch = jts.place_for(train_step, "batch", _tokens(), mesh)
    assert batch.sharding.spec == P("data", None)
    lengths = jts.place_for(train_step, "lengths", np.arange(16, dtype=np.int32), mesh)
    assert lengths.sharding.spec == P("data")
    assert int(train_step(batch, lengths, 1.0)) == int(_tokens().sum() + 120)
    jitted = jts.jit(train_step, static_argnums=2)
    again = jts.place_for(jitted, "batch", _tokens(), mesh)  # through the wrapper
    assert again.sharding == batch.sharding
    with pytest.raises(jts.ShardingAnnotationError, match="'batc' is not a parameter"):
        jts.place_for(train_step, "batc", _tokens(), mesh)
    with pytest.raises(jts.ShardingAnnotationError, match="has no sharding"):
        jts.place_for(train_step, "scale", np.float32(1.0), mesh)

    def unannotated(batch):
        return batch

    with pytest.raises(jts.ShardingAnnotationError, match="'batch' is not annotated"):
        jts.place_for(unannotated, "batch", _tokens(), mesh)


def test_local_rows_on_one_process(mesh):
    assert jts.local_rows(Tokens, (16, 8), mesh) == (slice(0, 16), slice(0, 8))
    assert jts.local_rows(P(None, "model"), (4, 6), mesh) == (slice(0, 4), slice(0, 6))
    with jax.set_mesh(mesh):
        assert jts.local_rows(Inline, (8, 2)) == (slice(0, 8), slice(0, 2))
    with pytest.raises(jts.PlacementError, match="cannot split evenly into 8"):
        jts.local_rows(Flat, (12, 8), mesh)


def test_blocks_arithmetic(mesh):
    # Read off the sharding: shard counts per dim, and which shards a process holds.
    info = _rows.blocks(NamedSharding(mesh, P(("data", "model"), None)), 2)
    assert info.counts == (8, 1)
    assert info.held == {0: (tuple(range(8)), (0,))}
    info = _rows.blocks(NamedSharding(mesh, P(None, "model")), 3)
    assert info.counts == (1, 2, 1)


def test_same_meaning_on_one_process_for_a_replicated_batch(mesh):
    # Replicated over `model`: every device of a `data` row holds the same rows.
    x = jts.place(_tokens(), Tokens, mesh)
    by_index = {}
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        by_index.setdefault(key, []).append(np.asarray(shard.data))
    assert len(by_index) == 4
    for key, blocks in by_index.items():
        assert len(blocks) == 2
        index = tuple(slice(*k) for k in key)
        np.testing.assert_array_equal(blocks[0], _tokens()[index])
        np.testing.assert_array_equal(blocks[1], blocks[0])


def test_verification_on_one_process_agrees_with_itself(mesh):
    # On one process `place` skips it (nothing to compare); the gather and the
    # verdicts still run here, as on each process of a job (see the 2-process test).
    local = [_tokens(), np.zeros((3,), np.float32)]
    names = ["local[0]", "local[1]"]
    _verify.check_shapes(names, local, "place")
    shardings = [NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())]
    _verify.check_replicas(names, local, shardings, [(16, 8), (3,)], "place")
    assert _verify.checksum(local[0]) != _verify.checksum(local[0] + 1)
    assert _verify.checksum(local[0]) == _verify.checksum(local[0].copy())
    assert _rows.replica_groups(shardings[1], 1, [True]) == []  # one process


def test_logical_annotations_place_through_the_rules_in_force():
    mesh = jax.make_mesh(
        (4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    Batch = Int[Array, "batch seq", jts.Logical]
    local = _tokens()
    with jts.axis_rules({"batch": "fsdp", "seq": None}):
        x = jts.place(local, Batch, mesh)
        assert jts.local_rows(Batch, (16, 8), mesh) == (slice(0, 16), slice(0, 8))
    assert x.sharding.spec == P("fsdp", None)
    with jts.axis_rules({"batch": ("fsdp", "tensor"), "seq": None}):
        y = jts.place(local, Batch, mesh)
        with pytest.raises(jts.PlacementError, match="'fsdp' .4. x 'tensor' .2."):
            jts.place(local[:6], Batch, mesh)
    assert y.sharding.spec == P(("fsdp", "tensor"), None)
    np.testing.assert_array_equal(np.asarray(y), local)


def test_logical_jit_shardings_follow_the_rules():
    mesh = jax.make_mesh(
        (4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )

    def double(
        x: Float[Array, "batch embed", jts.Logical],
    ) -> Float[Array, "batch embed", jts.Logical]:
        return x * 2

    f = jts.jit(double, in_shardings="annotations", out_shardings="annotations")
    x = np.ones((8, 4), np.float32)
    with jax.set_mesh(mesh):
        with jts.axis_rules({"batch": "fsdp", "embed": None}):
            assert f(x).sharding.spec == P("fsdp", None)
        with jts.axis_rules({"batch": None, "embed": "tensor"}):
            assert f(x).sharding.spec == P(None, "tensor")
