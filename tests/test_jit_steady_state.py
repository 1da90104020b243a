"""A steady-state call (JAX's C++ dispatch, no Python of ours per leaf) still
catches a mis-sharded input: 100 good calls of a 30-leaf weight tree, then one
leaf deep in the tree placed otherwise, on Explicit and Auto meshes, through
`jts.jit(step)` and `jts.jit(step, in_shardings="annotations")`."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import no_transfers, place


L = jts.Logical
RULES = {"embed": None, "mlp": "model", "batch": "data"}
WIn = Float[Array, "embed mlp", L]
WOut = Float[Array, "mlp embed", L]
Scale = Float[Array, "embed", L("embed")]
Batch = Float[Array, "batch embed", L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w_in: WIn
    w_out: WOut
    scale: Scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    layers: list[Layer]


def step(w: Weights, x: Batch) -> tuple[Weights, Batch]:
    for layer in w.layers:
        x = x * layer.scale + 1.0
    return jax.tree.map(lambda p: p * 0.5, w), x


def _weights(mesh):
    layer = lambda: Layer(  # noqa: E731
        place(mesh, (4, 8), P(None, "model")),
        place(mesh, (8, 4), P("model", None)),
        place(mesh, (4,), P(None)),
    )
    return Weights([layer() for _ in range(10)])  # 30 leaves


@pytest.fixture(params=["explicit", "auto"])
def kind(request):
    return request.param


@pytest.mark.parametrize("annotations", [False, True], ids=["jit", "annotations"])
def test_mis_sharded_leaf_after_100_good_calls(kind, annotations):
    mesh = make_mesh((4, 2), ("data", "model"), kind)
    kwargs = (
        dict(in_shardings="annotations", out_shardings="annotations")
        if annotations
        else {}
    )
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        f = jts.jit(step, **kwargs)
        w, x = _weights(mesh), place(mesh, (8, 4), P("data", None))
        assert len(jax.tree.leaves(w)) == 30
        want = f(w, x)
        with no_transfers():  # a steady-state call moves nothing
            outs = [f(w, x) for _ in range(100)]
        for out in outs[::33]:
            np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(want[1]))
        # One leaf, deep in the tree, replicated instead of split over `model`.
        bad = Weights(list(w.layers))
        bad.layers[7] = dataclasses.replace(
            w.layers[7],
            w_out=jax.device_put(w.layers[7].w_out, NamedSharding(mesh, P())),
        )
        with pytest.raises(jts.ShardingTypeCheckError) as caught:
            f(bad, x)
        text = str(caught.value)
        assert "layers[7].w_out" in text
        assert "layers[7].w_in" not in text and "layers[6].w_out" not in text
        # And the batch placed otherwise: caught too, by its name.
        with pytest.raises(jts.ShardingTypeCheckError, match=r"\bx\b"):
            f(w, place(mesh, (8, 4), P(None, "model")))
        # The good tree is accepted again, and steady again.
        for _ in range(3):
            out = f(w, x)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(want[1]))
        # Caught again after the steady state resumed (no verdict is kept
        # for a layout that was refused once).
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layers\[7\]\.w_out"):
            f(bad, x)


def test_mode_off_steady_then_check_catches(kind):
    # 100 calls in mode off (nothing checked), then mode check: the mis-sharded
    # leaf is caught at the first call in check, the steady state of off
    # notwithstanding.
    mesh = make_mesh((4, 2), ("data", "model"), kind)
    with jax.set_mesh(mesh), jts.axis_rules(RULES):
        f = jts.jit(step, in_shardings="annotations", out_shardings="annotations")
        w, x = _weights(mesh), place(mesh, (8, 4), P("data", None))
        bad = Weights(list(w.layers))
        bad.layers[0] = dataclasses.replace(
            w.layers[0], w_in=jax.device_put(w.layers[0].w_in, NamedSharding(mesh, P()))
        )
        with jts.set_mode("off"):
            for _ in range(100):
                f(w, x)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"layers\[0\]\.w_in"):
            f(bad, x)
