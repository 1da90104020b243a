"""A step's inputs on a mesh with no devices: `jts.abstract`, `jts.shardings` and
`jts.explain` take an `AbstractMesh`; `sharded_init` and `place` run inside a
trace (an input pipeline under `jax.eval_shape`), and `place` / `local_rows` on
an `AbstractMesh` make no array."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int
from jaxtyping_shard.pytest_plugin import make_mesh


@pytest.fixture(params=["explicit", "auto"])
def pod(request):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[request.param]
    return AbstractMesh((512, 8), ("data", "model"), axis_types=(kind,) * 2)


Bias = Float[Array, "mlp", jts.Logical]


@jts.jaxtyped(typechecker=beartype)
class Dense(eqx.Module):
    w: Float[Array, "embed mlp", jts.Logical]
    b: Bias

    def __init__(self, key, embed: int, mlp: int):
        self.w = jax.random.normal(key, (embed, mlp))
        self.b = jnp.zeros(mlp)


RULES = {"embed": "data", "mlp": "model"}
Tokens = Int[Array, "batch seq", P("data", None)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    tokens: Tokens


def test_abstract_shardings_and_explain_take_an_abstract_mesh(pod):
    with jts.axis_rules(RULES):
        tree = jts.abstract(Dense, jax.random.key(0), 4096, 1024, mesh=pod)
        assert tree.w.sharding == NamedSharding(pod, P("data", "model"))
        assert tree.b.sharding.spec == P("model")
        assert jts.shardings(tree, pod).w == NamedSharding(pod, P("data", "model"))
        rows = {r.path: r for r in jts.explain(tree, pod).rows}
        assert (
            rows[".w"].shard_shape == (8, 128) and rows[".w"].bytes_per_device == 4096
        )
        # A mesh of another size in context does not get in the way.
        with jax.set_mesh(make_mesh((4, 2), ("data", "model"), "explicit")):
            again = jts.abstract(Dense, jax.random.key(0), 4096, 1024, mesh=pod)
        assert again.w.sharding.mesh == pod
        with pytest.raises(jts.ShardingAnnotationError, match="dim 0 \\(4000\\)"):
            jts.abstract(Dense, jax.random.key(0), 4000, 1024, mesh=pod)
    with pytest.raises(ValueError, match="jts.abstract"):
        jts.sharded_init(Dense, jax.random.key(0), 4096, 1024, mesh=pod)


def pipeline(mesh):
    """An input pipeline as a program writes it: parameters and a batch."""
    with jts.axis_rules(RULES):
        params = jts.sharded_init(Dense, jax.random.key(0), 4096, 1024, mesh=mesh)
    tokens = np.arange(1024 * 16, dtype=np.int32).reshape(1024, 16)
    rows = jts.local_rows(Tokens, tokens.shape, mesh)
    return params, jts.place(Batch(tokens[rows]), None, mesh)


def test_an_input_pipeline_under_eval_shape(pod):
    if pod.axis_types[0] == AxisType.Auto:
        # `jax.eval_shape` reports no shardings on Auto axes (jax#19656): the
        # values are laid out inside the trace, but the result cannot say so.
        out = jax.eval_shape(lambda: pipeline(pod))
        assert out[0].w.shape == (4096, 1024)
        return
    with jax.sharding.use_abstract_mesh(pod):
        params, batch = jax.eval_shape(lambda: pipeline(pod))
    assert params.w.sharding == NamedSharding(pod, P("data", "model"))
    assert batch.tokens.sharding.spec == P("data", None)
    assert batch.tokens.shape == (1024, 16)  # one process holds every row


def test_place_and_local_rows_on_an_abstract_mesh_make_no_array(pod):
    before = jax.live_arrays()
    rows = jts.local_rows(Tokens, (1024, 16), pod)
    assert rows == (slice(0, 1024), slice(0, 16))
    out = jts.place(np.zeros((1024, 16), np.int32), Tokens, pod)
    assert out == jax.ShapeDtypeStruct(
        (1024, 16), jnp.int32, sharding=NamedSharding(pod, P("data", None))
    )
    known = {id(a) for a in before}
    assert [a for a in jax.live_arrays() if id(a) not in known] == []
    with pytest.raises(jts.PlacementError, match="not a multiple of 512"):
        jts.place(np.zeros((1000, 16), np.int32), Tokens, pod)


def test_sharded_init_and_place_inside_jit(mesh_4x2):
    """The same, compiled and run on a real mesh: laid out as annotated."""

    @jax.jit
    def make():
        return pipeline(mesh_4x2)

    with jax.set_mesh(mesh_4x2):
        params, batch = make()
    assert params.w.sharding.is_equivalent_to(
        NamedSharding(mesh_4x2, P("data", "model")), 2
    )
    assert batch.tokens.sharding.is_equivalent_to(NamedSharding(mesh_4x2, P("data")), 2)
    assert int(np.asarray(batch.tokens)[3, 2]) == 3 * 16 + 2
