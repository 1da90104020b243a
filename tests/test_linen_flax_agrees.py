"""Agreement with Flax Linen (issue 34, item 1): on random Linen modules (Dense,
Embed, einsum-style params) and random Linen rules tables, `jts.shardings`
gives, leaf for leaf, what `nn.logical_to_mesh_sharding(nn.get_partition_spec(
boxed), mesh, rules)` gives (`nn.get_sharding` for `nn.Partitioned`); where the
library is stricter (a name no rule maps, a rule whose mesh axes another dim
took), its error says what Linen would give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtyping_shard as jts
from jaxtyping_shard.pytest_plugin import make_mesh


nn = pytest.importorskip("flax.linen")
meta = pytest.importorskip("flax.core.meta")

NAMES = ("batch", "embed", "mlp", "heads", "kv", "vocab", "layers")
INIT = nn.initializers.normal(0.02)
CASES = 60


class Random(nn.Module):
    """Layers from a tuple of `(kind, names, features)`: Dense, Embed, or an
    einsum-style 3-d param, each boxed logically or by mesh axes."""

    layers: tuple

    @nn.compact
    def __call__(self, x):
        for i, (kind, names, box, sizes) in enumerate(self.layers):
            wrap = (
                nn.with_logical_partitioning
                if box == "logical"
                else (nn.with_partitioning)
            )
            init = wrap(INIT, names)
            if kind == "dense":
                nn.Dense(sizes[1], kernel_init=init, use_bias=False, name=f"d{i}")(
                    jnp.zeros((2, sizes[0]))
                )
            elif kind == "embed":
                nn.Embed(sizes[0], sizes[1], embedding_init=init, name=f"e{i}")(
                    jnp.zeros((2,), jnp.int32)
                )
            else:
                self.param(f"w{i}", init, sizes)
        return x


def _mesh_names(rng, axes):
    pick = rng.integers(0, 4)
    if pick == 0:
        return None
    if pick == 3 and len(axes) > 1:
        return tuple(rng.choice(axes, 2, replace=False).tolist())
    return str(rng.choice(axes))


def _case(seed, axes):
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(rng.integers(1, 5)):
        kind = str(rng.choice(["dense", "embed", "einsum"]))
        rank = 3 if kind == "einsum" else 2
        sizes = tuple(int(8 * rng.integers(1, 4)) for _ in range(rank))
        if rng.random() < 0.25:  # `nn.Partitioned`: mesh axes, distinct
            order = rng.permutation(list(axes) + [None] * rank).tolist()[:rank]
            names = tuple(None if n is None else str(n) for n in order)
            layers.append((kind, names, "mesh", sizes))
            continue
        chosen = rng.choice(NAMES, rank, replace=False).tolist()
        names = tuple(None if rng.random() < 0.15 else str(n) for n in chosen)
        layers.append((kind, names, "logical", sizes))
    rules = []
    for name in NAMES:
        for _ in range(int(rng.choice([0, 1, 1, 1, 2]))):  # 0: no rule
            rules.append((name, _mesh_names(rng, axes)))
    rng.shuffle(rules)
    return Random(tuple(layers)), [tuple(r) for r in rules]


def _linen_expected(boxed, mesh, rules):
    def one(box):
        if isinstance(box, nn.LogicallyPartitioned):
            spec = nn.logical_to_mesh_axes(box.names, rules)
        else:
            spec = box.get_partition_spec()
        return (spec, box.value.shape)

    return jax.tree.leaves(
        jax.tree.map(one, boxed, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)),
        is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], P),
    )


def _shown(spec):
    def entry(e):
        if e is None:
            return "None"
        if isinstance(e, tuple):
            return repr(e[0]) if len(e) == 1 else repr(e)
        return repr(e)

    return f"P({', '.join(entry(e) for e in spec)})"


MESH_SHAPES = [((4, 2), ("data", "model")), ((2, 2, 2), ("data", "fsdp", "tensor"))]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_shardings_agree_with_linen(kind):
    agreed = refused = whole = logical = 0
    for seed in range(CASES):
        shape, axes = MESH_SHAPES[seed % 2]
        mesh = make_mesh(shape, axes, kind)
        module, rules = _case(seed, axes)
        boxed = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros(()))
        expected = _linen_expected(boxed, mesh, rules)
        boxes = jax.tree.leaves(
            boxed, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
        )
        assert len(boxes) == len(expected) > 0
        # Flax's own sharding tree, for the same boxes (a check of the oracle).
        flax_tree = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(boxed), mesh, rules
        )
        for box, got_flax, (spec, _) in zip(
            boxes, jax.tree.leaves(flax_tree), expected
        ):
            if isinstance(box, nn.LogicallyPartitioned):
                assert got_flax.spec == spec
            else:
                assert nn.get_sharding(box, mesh).spec == spec
        before = refused
        for box, (spec, shape_) in zip(boxes, expected):
            where = f"seed {seed}: {type(box).__name__}{box.names} under {rules}"
            try:
                if seed % 3:
                    got = jts.shardings(box, mesh, axis_rules=rules)
                else:
                    with jts.axis_rules(rules):
                        got = jts.shardings(box, mesh)
            except jts.ShardingAnnotationError as e:
                assert isinstance(box, nn.LogicallyPartitioned), where
                assert f"Linen would give {_shown(spec)} here" in str(e), (
                    where,
                    str(e),
                )
                refused += 1
                continue
            ours = got.value
            linen = jax.sharding.NamedSharding(mesh, spec)
            assert ours.is_equivalent_to(linen, len(shape_)), (where, ours.spec)
            agreed += 1
            logical += isinstance(box, nn.LogicallyPartitioned)
        if refused == before:  # the whole tree, in one call, agrees too
            tree = jts.shardings(boxed, mesh, axis_rules=rules)
            for ours, (spec, shape_) in zip(jax.tree.leaves(tree), expected):
                linen = jax.sharding.NamedSharding(mesh, spec)
                assert ours.is_equivalent_to(linen, len(shape_)), (seed, ours.spec)
            whole += 1
    # Both outcomes are exercised, and most leaves agree outright.
    assert agreed >= 80 and logical >= 40, (agreed, logical)
    assert refused >= 10 and whole >= 10, (refused, whole)
