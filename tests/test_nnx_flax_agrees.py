"""Differential: `jts.shardings` of NNX metadata equals Flax's own resolution
(`nnx.get_named_sharding` under `nnx.logical_axis_rules`, the same table) on
random modules and rules tables; where Flax's answer is no sharding JAX takes (a
name no rule maps that the mesh lacks, two dims on one axis), jaxtyping_shard
refuses and says what Flax would have made of it."""

import random

import jax
import jax.numpy as jnp
import pytest

import jaxtyping_shard as jts

from .helpers import MESHES


nnx = pytest.importorskip("flax.nnx")

LOGICAL = ("batch", "embed", "mlp", "heads", "vocab")
TARGETS = ("data", "model", ("data", "model"), None)
CASES = 60


class Bag(nnx.Module):
    def __init__(self, shardings):
        with nnx.use_eager_sharding(False):
            self.params = nnx.List(
                [nnx.Param(jnp.zeros((8,) * len(s)), out_sharding=s) for s in shardings]
            )


def _case(rng):
    names = rng.sample(LOGICAL, rng.randint(0, len(LOGICAL)))
    rules = tuple((n, rng.choice(TARGETS)) for n in names)
    # Mostly names with a rule; sometimes a mesh axis named directly, None, or a
    # name with no rule (which Flax passes to the mesh as is).
    pool = [*names, "data", "model", None, None, rng.choice(LOGICAL)]
    shardings = [
        tuple(rng.choice(pool) for _ in range(rng.randint(1, 3)))
        for _ in range(rng.randint(1, 3))
    ]
    return rules, shardings


def _flax(model, rules, mesh):
    """Flax's NamedSharding per Param, or the exception it raises."""
    out = []
    with nnx.logical_axis_rules(rules):
        for p in model.params:
            try:
                got = nnx.get_named_sharding(p, mesh).get_value()
            except Exception as error:
                got = error
            out.append(got)
    return out


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_jts_resolves_nnx_metadata_as_flax_does(kind):
    mesh = MESHES[kind]()
    rng = random.Random(24)
    agreed = refused = stricter = 0
    for _ in range(CASES):
        rules, shardings = _case(rng)
        model = Bag(shardings)
        flax = _flax(model, rules, mesh)
        for table in (list(rules), dict(rules)):
            if not table:
                table = None  # no rules at all: mesh axes only
            for p, expected in zip(model.params, flax):
                with jts.axis_rules(table):
                    if isinstance(expected, Exception):
                        with pytest.raises(jts.ShardingAnnotationError) as info:
                            jts.shardings(p, mesh=mesh)
                        assert "Flax would resolve it to P(" in str(info.value)
                        refused += 1
                        continue
                    written = p.get_metadata()["out_sharding"]
                    if _stricter(written, table):
                        # A list of pairs gives a rule to the first dim of its
                        # name only (Linen); Flax NNX to every dim: refused,
                        # saying what Flax makes of it.
                        with pytest.raises(jts.ShardingAnnotationError) as info:
                            jts.shardings(p, mesh=mesh)
                        flax_text = f"Flax would resolve it to {_shown(expected)}"
                        assert flax_text in str(info.value)
                        stricter += 1
                        continue
                    got = jts.shardings(p, mesh=mesh).get_value()
                assert got.is_equivalent_to(expected, len(written)), (rules, p, got)
                agreed += 1
    # The cases hold every kind, in numbers.
    assert agreed >= 50 and refused >= 10 and stricter >= 1, (agreed, refused)


def _stricter(written, table):
    named = [n for n in written if n in LOGICAL]
    return isinstance(table, list) and len(set(named)) < len(named)


def _shown(sharding):
    def entry(e):
        if e is None:
            return "None"
        if isinstance(e, tuple):
            return "(" + ", ".join(repr(a) for a in e) + ")"
        return repr(e)

    return "P(" + ", ".join(entry(e) for e in sharding.spec) + ")"


def test_fully_replicated_metadata_as_flax():
    mesh = MESHES["explicit"]()
    model = Bag([(None, None), (None,)])
    flax = _flax(model, (), mesh)
    for p, expected in zip(model.params, flax):
        got = jts.shardings(p, mesh=mesh).get_value()
        assert got.is_equivalent_to(expected, 2)
        assert got.is_fully_replicated


def test_no_metadata_declares_nothing_where_flax_says_replicated():
    """A Param without `out_sharding`: Flax's `get_partition_spec` says `P()`;
    here it declares nothing (unchecked, counted by `check_tree`), as a field
    without a sharded annotation does."""
    mesh = MESHES["explicit"]()
    with nnx.use_eager_sharding(False):
        p = nnx.Param(jnp.zeros((8, 8)))
    assert nnx.get_partition_spec(p).get_value() == jax.P()
    assert jts.shardings(p, mesh=mesh).get_value() is None
    # Checking it alone checks nothing: refused unless said to be expected.
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.value: no annot"):
        jts.check_tree(p)
    summary = jts.check_tree(p, summary=True, may_check_nothing=True)
    assert summary.checked == 0 and summary.unannotated == ("tree.value",)
