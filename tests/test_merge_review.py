"""Edges a review of this wave's merged change found, each as its class.

- `like=` on a tree outside the parameters' structure holding a parameter's
  shape (a restore into plain dicts) is refused, not taken as a moment-free
  state (`sgd(schedule)`, whose leaves are scalars, still passes replicated);
- inside `shard_map` (Manual axes) a concrete sharding's target is not refused
  for its axis types;
- `check_tree` that checks nothing follows the mode: raised, warned, or nothing;
- `like=` / `stacked=` keep an annotation's unreduced axes (JAX 0.10 refuses
  to iterate such a spec);
- an unreduced axis the mesh lacks is an annotation error in `explain`;
- `jts.einsum` keeps a `NamedSharding` `out_sharding=`, and refuses it beside
  `unreduced=True`.
"""

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import place


class Params(NamedTuple):
    w: jax.Array


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_restore_into_plain_dicts_is_refused_by_like(kind):
    mesh = make_mesh((4, 2), ("data", "model"), kind)
    params = Params(place(mesh, (8, 4), P("data")))
    rep = place(mesh, (8, 4), P())
    state = {"0": {"mu": {"w": rep}, "nu": {"w": rep}, "count": jnp.zeros(())}}
    with pytest.raises(jts.ShardingTypeCheckError) as found:
        jts.check_tree(state, like=params, name="opt_state")
    assert "opt_state['0']['mu']['w']" in str(found.value)
    # No parameter's shape anywhere: a moment-free state, replicated.
    for opt in (optax.sgd(optax.constant_schedule(0.1)), optax.noisy_sgd(0.1, key=0)):
        summary = jts.check_tree(opt.init(params), like=params, summary=True)
        assert summary.checked == summary.leaves


def test_inside_shard_map_a_named_sharding_target_is_not_refused_for_manual_axes():
    mesh = make_mesh((8,), ("x",), "explicit")
    x = place(mesh, (8, 4), P("x"))

    def body(local):
        total = jax.lax.psum(local, "x")
        jts.check_tree(total, annotations=NamedSharding(mesh, P()))
        return total

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))(x)
    assert out.shape == (1, 4)

    def wrong(local):  # varies over x: not replicated, and says so
        jts.check_tree(local, annotations=NamedSharding(mesh, P()))
        return local

    with pytest.raises(jts.ShardingTypeCheckError, match="varies over 'x'"):
        jax.jit(jax.shard_map(wrong, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)


def test_nothing_checked_follows_the_mode():
    tree = {"w": jnp.ones((8, 4))}
    with pytest.raises(jts.ShardingTypeCheckError, match="may_check_nothing"):
        jts.check_tree(tree)
    with jts.set_mode("warn"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert jts.check_tree(tree) is tree
    assert any("may_check_nothing" in str(w.message) for w in seen)
    with jts.set_mode("off"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jts.check_tree(tree) is tree


def test_like_and_stacked_keep_unreduced_axes():
    from jaxtyping_shard._layout import spec as _spec
    from jaxtyping_shard._trees.like import stacked_spec

    mesh = make_mesh((8,), ("x",), "explicit")
    where = NamedSharding(mesh, P())
    leaf = jax.ShapeDtypeStruct((3, 8, 4), jnp.float32, sharding=where)
    spec = stacked_spec(leaf, jts.Float[Array, "a b {U:x}"], (None,), "like")
    assert spec.unreduced == {"x"}
    assert _spec.partitions_of(spec) == (None, None, None)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_explain_names_an_unreduced_axis_the_mesh_lacks(kind):
    mesh = make_mesh((8,), ("x",), kind)
    leaf = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
    with pytest.raises(jts.ShardingAnnotationError, match=r"\['data'\].*lacks"):
        jts.explain(leaf, mesh, annotations={"w": jts.Float[Array, "a b {U:data}"]})


def test_einsum_keeps_a_named_sharding_and_refuses_it_beside_unreduced():
    mesh = make_mesh((8,), ("x",), "explicit")
    a, b = place(mesh, (8, 4), P("x")), jnp.ones((4, 4))
    out = jts.einsum("ij,jk->ik", a, b, out_sharding=NamedSharding(mesh, P("x")))
    assert out.sharding.spec == P("x", None)
    with pytest.raises(jts.ShardingAnnotationError, match="one of them"):
        jts.einsum("ij,jk->ik", a, b, out_sharding=P("x"), unreduced=True)
