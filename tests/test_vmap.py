"""Annotated functions under `vmap`: an annotation describes one example.

Explicit axes read the per-example type at trace time; Auto axes compare the
sharding XLA chose for the batched value, minus its batch dims, with the
per-example annotation. Both must agree, whatever `in_axes`, and whether the
function was traced with or without `vmap` first (issue 9, items 4 and 5).
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


GOOD = Float[Array, "b e", P("data", None)]
WRONG = Float[Array, "b e", P("model", None)]
REPLICATED = Float[Array, "b e", P()]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return make_mesh((4, 2), ("data", "model"), request.param)


# (batched shape, its sharding, in_axes): every example is (8, 4) sharded P("data").
LAYOUTS = [
    ((3, 8, 4), P(None, "data", None), 0),
    ((8, 3, 4), P("data", None, None), 1),
    ((8, 4, 3), P("data", None, None), 2),
]


@pytest.mark.parametrize("shape, spec, axis", LAYOUTS)
@pytest.mark.parametrize("form", ["vmap(jit)", "jit(vmap)"])
def test_per_example_verdict(mesh, shape, spec, axis, form):
    x = place(mesh, shape, spec)

    def run(annotation):
        f = make_identity("beartype", annotation, annotation)
        fn = (
            jax.vmap(jax.jit(f), in_axes=axis, out_axes=axis)
            if form == "vmap(jit)"
            else jax.jit(jax.vmap(f, in_axes=axis, out_axes=axis))
        )
        return fn(x)

    with no_transfers():
        assert run(GOOD).shape == shape
        for wrong in (WRONG, REPLICATED):
            with pytest.raises(CHECK_ERRORS):
                run(wrong)


def test_auto_message_is_per_example(mesh_auto):
    x = place(mesh_auto, (3, 8, 4), P(None, "model", None))
    f = jax.jit(make_identity("beartype", GOOD, GOOD))
    f(place(mesh_auto, (8, 4), P("data")))  # traced without vmap first (item 5)
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.vmap(f)(x)
    assert "XLA sharded it as `float32[8@model,4]`" in str(info.value)


def test_vmap_first_does_not_disable_later_checks(mesh):
    # Item 4: the trace made under vmap was reused without its check by later
    # calls with the same per-example shapes.
    f = jax.jit(make_identity("beartype", GOOD, GOOD))
    assert jax.vmap(f)(place(mesh, (3, 8, 4), P(None, "data"))).shape == (3, 8, 4)
    assert f(place(mesh, (8, 4), P("data"))).shape == (8, 4)
    with pytest.raises(CHECK_ERRORS):
        f(place(mesh, (8, 4), P("model")))
    with pytest.raises(CHECK_ERRORS):
        jts.jit(make_identity("beartype", GOOD, GOOD))(place(mesh, (8, 4), P()))


def test_nested_vmap(mesh):
    x = place(mesh, (2, 3, 8, 4), P(None, None, "data"))
    good = jax.jit(jax.vmap(jax.vmap(make_identity("beartype", GOOD, GOOD))))
    assert good(x).shape == (2, 3, 8, 4)
    bad = jax.jit(jax.vmap(jax.vmap(make_identity("beartype", WRONG, WRONG))))
    with pytest.raises(CHECK_ERRORS):
        bad(x)


def test_batch_dim_sharded_over_a_mesh_axis(mesh, request):
    from jax.sharding import AxisType

    from jaxtyping_shard._core import compat as _compat

    if AxisType.Explicit in mesh.axis_types:
        request.applymarker(
            pytest.mark.xfail(
                not _compat.vmap_spmd_axis_name_on_explicit_axes(),
                reason="JAX 0.8 refuses spmd_axis_name over an Explicit axis",
                raises=ValueError,
            )
        )
    # The batch dim's own sharding is not part of the per-example annotation.
    x = place(mesh, (2, 8, 4), P("model", "data"))
    good = jax.vmap(make_identity("beartype", GOOD, GOOD), spmd_axis_name="model")
    assert jax.jit(good)(x).shape == (2, 8, 4)
    bad = jax.vmap(make_identity("beartype", WRONG, WRONG), spmd_axis_name="model")
    with pytest.raises(CHECK_ERRORS):
        jax.jit(bad)(x)
