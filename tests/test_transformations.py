"""Annotated functions under JAX's transformations: checked, or skipped as documented.

Explicit axes: every transformation below checks, mismatches included. Auto axes:
checked at compile time, except under `eval_shape` (nothing is compiled); `vmap`
is in tests/test_vmap.py.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


GOOD = Float[Array, "b e", P("data", None)]
BAD = Float[Array, "b e", P("model", None)]


def _transforms(checked):
    """name -> function of x (8, 4) using `checked` on a (8, 4) value."""
    return {
        "jit": jax.jit(checked),
        "nested_jit": jax.jit(lambda x: jax.jit(checked)(x) * 2),
        "grad": jax.jit(jax.grad(lambda x: checked(x).sum())),
        "value_and_grad": jax.jit(jax.value_and_grad(lambda x: checked(x).sum())),
        "scan": jax.jit(
            lambda x: jax.lax.scan(lambda c, _: (checked(c), None), x, None, length=2)[
                0
            ]
        ),
        "cond": jax.jit(lambda x: jax.lax.cond(x.sum() > 0, checked, lambda v: v, x)),
        "while_loop": jax.jit(
            lambda x: jax.lax.while_loop(
                lambda c: c[1] < 2, lambda c: (checked(c[0]), c[1] + 1), (x, 0)
            )[0]
        ),
        "checkpoint": jax.jit(jax.checkpoint(checked)),
        "named_call": jax.jit(jax.named_call(checked, name="checked_call")),
        "grad_of_checkpoint": jax.jit(
            jax.grad(lambda x: jax.checkpoint(checked)(x).sum())
        ),
    }


NAMES = list(_transforms(lambda x: x))


@pytest.mark.parametrize("name", NAMES)
def test_explicit(name, checker, mesh_explicit):
    x = place(mesh_explicit, (8, 4), P("data"))
    good = _transforms(make_identity(checker, GOOD, GOOD))[name]
    bad = _transforms(make_identity(checker, BAD, BAD))[name]
    with jax.set_mesh(mesh_explicit), no_transfers():
        jax.block_until_ready(good(x))
        with pytest.raises(CHECK_ERRORS):
            bad(x)


@pytest.mark.parametrize("name", NAMES)
def test_auto(name, mesh_auto):
    x = place(mesh_auto, (8, 4), P("data"))
    good = _transforms(make_identity("beartype", GOOD, GOOD))[name]
    bad = _transforms(make_identity("beartype", BAD, BAD))[name]
    with jax.set_mesh(mesh_auto), no_transfers():
        with jts.sharding_errors():
            jax.block_until_ready(good(x))
        with pytest.raises(jts.ShardingTypeCheckError), jts.sharding_errors():
            bad(x)


def test_eval_shape(mesh_explicit, mesh_auto):
    x = place(mesh_explicit, (8, 4), P("data"))
    with pytest.raises(CHECK_ERRORS):  # Explicit: checked while tracing
        jax.eval_shape(make_identity("beartype", BAD, BAD), x)
    assert jax.eval_shape(make_identity("beartype", GOOD, GOOD), x).shape == (8, 4)
    xa = place(mesh_auto, (8, 4), P("data"))
    # Auto: nothing is compiled, so nothing is checked (documented).
    assert jax.eval_shape(make_identity("beartype", BAD, BAD), xa).shape == (8, 4)


PER_EXAMPLE_GOOD = Float[Array, "e", P("model")]
PER_EXAMPLE_BAD = Float[Array, "e", P()]


@pytest.mark.parametrize("outer_jit", [False, True])
def test_vmap_explicit_is_per_example(outer_jit, checker, mesh_explicit):
    # Under vmap an annotation describes one example: the batch dim is gone from
    # both its shape and its sharding.
    x = place(mesh_explicit, (8, 4), P("data", "model"))
    good = jax.vmap(make_identity(checker, PER_EXAMPLE_GOOD, PER_EXAMPLE_GOOD))
    bad = jax.vmap(make_identity(checker, PER_EXAMPLE_BAD, PER_EXAMPLE_BAD))
    if outer_jit:
        good, bad = jax.jit(good), jax.jit(bad)
    with no_transfers():
        assert good(x).shape == (8, 4)
        with pytest.raises(CHECK_ERRORS):
            bad(x)


def test_shard_map_inside_jit_and_grad(mesh_explicit):
    Local = Float[Array, "b e", P("data", None)]
    checked = make_identity("beartype", Local, Local)
    smap = jax.shard_map(
        checked, mesh=mesh_explicit, in_specs=P("data"), out_specs=P("data")
    )
    x = place(mesh_explicit, (8, 4), P("data"))
    with jax.set_mesh(mesh_explicit):
        assert jax.jit(jax.grad(lambda v: smap(v).sum()))(x).shape == (8, 4)
        wrong = make_identity("beartype", Float[Array, "b e", P()], Local)
        smap_bad = jax.shard_map(
            wrong, mesh=mesh_explicit, in_specs=P("data"), out_specs=P("data")
        )
        with pytest.raises(CHECK_ERRORS):
            jax.jit(jax.grad(lambda v: smap_bad(v).sum()))(x)
