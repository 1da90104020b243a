"""`jts.filter_jit`: `eqx.filter_jit` with the boundary checks and annotation
shardings of `jts.jit`, on Explicit and Auto meshes."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float


eqx = pytest.importorskip("equinox")


class Block(eqx.Module):
    w_in: Float[Array, "embed@data mlp"]
    w_out: Float[Array, "mlp embed@data"]
    act: str = eqx.field(static=True, default="tanh")


class Model(eqx.Module):
    blocks: list[Block]
    head: eqx.nn.Linear  # a stock layer: arrays unannotated
    mlp: eqx.nn.MLP  # callable fields: its activation functions


def make_model(mesh):
    keys = jax.random.split(jax.random.key(0), 4)
    fsdp = NamedSharding(mesh, P("data", None))
    blocks = [
        Block(
            jax.device_put(jax.random.normal(k, (8, 16)), fsdp),
            jax.device_put(
                jax.random.normal(k, (16, 8)), NamedSharding(mesh, P(None, "data"))
            ),
        )
        for k in keys[:2]
    ]
    head = eqx.nn.Linear(8, 4, key=keys[2])
    mlp = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.gelu, key=keys[3])
    return Model(blocks, head, mlp)


def gather(w):
    """`w` replicated where the mesh's `data` axis is Explicit (FSDP's gather)."""
    mesh = jax.typeof(w).sharding.mesh
    if mesh.axis_types and mesh.axis_types[0] == AxisType.Explicit:
        return jax.sharding.reshard(w, P())
    return w


def forward(model: Model, x, scale):
    for block in model.blocks:
        act = getattr(jnp, block.act)
        x = act(x @ gather(block.w_in)) @ gather(block.w_out)
    return jax.vmap(model.mlp)(jax.vmap(model.head)(x)) * scale


def replicated(mesh, model, where):
    """`model` with the leaf `where` picks replicated: the planted bug."""
    leaf = where(model)
    return eqx.tree_at(where, model, jax.device_put(leaf, NamedSharding(mesh, P())))


def test_stock_layers_as_filter_jit(mesh_4x2):
    # eqx.nn layers with callable fields, a static field, a Python float: the
    # same result as eqx.filter_jit's, with the annotated leaves checked.
    model = make_model(mesh_4x2)
    x = jnp.ones((4, 8))
    with jax.set_mesh(mesh_4x2):
        ours = jts.filter_jit(forward)(model, x, 0.5)
        theirs = eqx.filter_jit(forward)(model, x, 0.5)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)
    assert ours.shape == (4, 2)


def test_non_array_results_pass_through(mesh_4x2):
    model = make_model(mesh_4x2)

    def f(model, n: int):
        return model, n, "tag"

    with jax.set_mesh(mesh_4x2):
        for kwargs in ({}, {"in_shardings": "annotations"}):
            out, n, tag = jts.filter_jit(f, **kwargs)(model, 3)
            assert (n, tag) == (3, "tag")
            assert out.mlp.activation is jax.nn.gelu
            assert out.blocks[0].act == "tanh"
            assert out.blocks[0].w_in.sharding.is_equivalent_to(
                NamedSharding(mesh_4x2, P("data", None)), 2
            )


@pytest.mark.parametrize("annotations", [False, True])
def test_planted_leaf_caught_by_path(mesh_4x2, annotations):
    model = make_model(mesh_4x2)
    bad = replicated(mesh_4x2, model, lambda m: m.blocks[1].w_in)
    kwargs = {"in_shardings": "annotations"} if annotations else {}
    f = jts.filter_jit(forward, **kwargs)
    x = jnp.ones((4, 8))
    with jax.set_mesh(mesh_4x2):
        f(model, x, 1.0)  # no false alarm
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\[1\]\.w_in"):
            f(bad, x, 1.0)


def test_planted_leaf_caught_on_mixed_mesh():
    from .helpers import mixed_mesh  # a helper of the tests, not of the package

    mesh = mixed_mesh()
    model = make_model(mesh)
    bad = replicated(mesh, model, lambda m: m.blocks[0].w_out)
    f = jts.filter_jit(forward)
    with jax.set_mesh(mesh):
        f(model, jnp.ones((4, 8)), 1.0)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\[0\]\.w_out"):
            f(bad, jnp.ones((4, 8)), 1.0)


@pytest.mark.parametrize("annotations", [False, True])
def test_warm_cache_change_placement_call_again(mesh_4x2, annotations):
    # Call (compiled, cached), change one leaf's placement (a new signature for
    # JAX's caches), call again: caught; the good tree still runs from the cache.
    model = make_model(mesh_4x2)
    kwargs = {"in_shardings": "annotations"} if annotations else {}
    f = jts.filter_jit(forward, **kwargs)
    x = jnp.ones((4, 8))
    with jax.set_mesh(mesh_4x2):
        first = f(model, x, 1.0)
        f(model, x, 1.0)
        bad = replicated(mesh_4x2, model, lambda m: m.blocks[0].w_in)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\[0\]\.w_in"):
            f(bad, x, 1.0)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\[0\]\.w_in"):
            f(bad, x, 1.0)  # still refused: the failed trace was not cached
        np.testing.assert_array_equal(np.asarray(f(model, x, 1.0)), np.asarray(first))


def test_static_arguments_retrace_and_are_checked(mesh_4x2):
    model = make_model(mesh_4x2)
    traces = []

    def f(model: Model, x, act: str):
        traces.append(act)
        return getattr(jnp, act)(x @ gather(model.blocks[0].w_in))

    g = jts.filter_jit(f)
    x = jnp.ones((4, 8))
    with jax.set_mesh(mesh_4x2):
        a = g(model, x, "tanh")
        g(model, x, "tanh")
        b = g(model, x, "sin")
    assert traces == ["tanh", "sin"]  # a static argument is part of the key
    assert not np.allclose(np.asarray(a), np.asarray(b))
    bad = replicated(mesh_4x2, model, lambda m: m.blocks[0].w_in)
    with jax.set_mesh(mesh_4x2):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.blocks\[0\]"):
            g(bad, x, "cos")


def test_mode_off_then_on(mesh_4x2):
    model = make_model(mesh_4x2)
    bad = replicated(mesh_4x2, model, lambda m: m.blocks[1].w_out)
    f = jts.filter_jit(forward)
    x = jnp.ones((4, 8))
    with jax.set_mesh(mesh_4x2):
        jts.set_mode("off")
        f(bad, x, 1.0)  # no check
        jts.set_mode("check")
        with pytest.raises(jts.ShardingTypeCheckError, match=r"blocks\[1\]\.w_out"):
            f(bad, x, 1.0)  # the mode is part of JAX's cache key


@pytest.mark.parametrize("annotations", [False, True])
def test_donate(mesh_explicit, annotations):
    kwargs = {"in_shardings": "annotations"} if annotations else {}

    def step(w: Float[Array, "a@data b"], y: Float[Array, "a@data b"]):
        return w + y

    sharding = NamedSharding(mesh_explicit, P("data", None))
    w = jax.device_put(jnp.ones((8, 4)), sharding)
    y = jax.device_put(jnp.ones((8, 4)), sharding)
    out = jts.filter_jit(step, donate="all-except-first", **kwargs)(w, y)
    assert not w.is_deleted() and y.is_deleted()
    out = jts.filter_jit(step, donate="all", **kwargs)(out, out + 1)
    np.testing.assert_array_equal(np.asarray(out), 5.0)
    with pytest.raises(ValueError, match="donate='some'"):
        jts.filter_jit(step, donate="some")


def test_annotation_shardings(mesh_4x2):
    # in_shardings="annotations": an uncommitted array is placed as annotated;
    # out_shardings="annotations": the result laid out as its annotation says.
    def f(x: Float[Array, "b@data e"], fn) -> Float[Array, "b e@model"]:
        return fn(x)

    g = jts.filter_jit(f, in_shardings="annotations", out_shardings="annotations")
    with jax.set_mesh(mesh_4x2):
        out = g(np.ones((8, 4), np.float32), jnp.tanh)
        assert out.sharding.is_equivalent_to(
            NamedSharding(mesh_4x2, P(None, "model")), 2
        )
        np.testing.assert_allclose(np.asarray(out), np.tanh(1.0), rtol=1e-6)
        committed = jax.device_put(
            jnp.ones((8, 4)), NamedSharding(mesh_4x2, P("model"))
        )
        with pytest.raises(jts.ShardingTypeCheckError, match="`x`"):
            g(committed, jnp.tanh)
        moved = jts.filter_jit(f, in_shardings="annotations", reshard_inputs=True)
        assert moved(committed, jnp.sin).shape == (8, 4)


def test_return_checked_by_path(mesh_explicit):
    def f(model: Model) -> Model:
        where = lambda m: m.blocks[0].w_in
        return eqx.tree_at(where, model, jax.sharding.reshard(where(model), P()))

    model = make_model(mesh_explicit)
    with jax.set_mesh(mesh_explicit):
        with pytest.raises(
            jts.ShardingTypeCheckError, match=r"return value(.|\n)*blocks\[0\]\.w_in"
        ):
            jts.filter_jit(f)(model)


def test_rejects_jit_keywords():
    with pytest.raises(ValueError, match="static_argnums"):
        jts.filter_jit(forward, static_argnums=2)
    with pytest.raises(ValueError, match="static_argnums"):
        jts.filter_jit(forward, in_shardings="annotations", static_argnums=2)
    with pytest.raises(ValueError, match="in_shardings"):
        jts.filter_jit(forward, in_shardings=None)


def test_equinox_stays_optional():
    code = (
        "import sys\n"
        "import jaxtyping_shard as jts\n"
        "assert 'equinox' not in sys.modules\n"
        "sys.modules['equinox'] = None\n"
        "try:\n"
        "    jts.filter_jit(lambda x: x)\n"
        "except ImportError as e:\n"
        "    assert 'jaxtyping-shard[equinox]' in str(e)\n"
        "    print('ok')\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_lower_and_method(mesh_4x2):
    # `.lower` with derived shardings moves nothing; a method is bound as
    # eqx.filter_jit binds it.
    def f(x: Float[Array, "b@data e"], n: int) -> Float[Array, "b@data e"]:
        return x * n

    g = jts.filter_jit(f, in_shardings="annotations", out_shardings="annotations")
    with jax.set_mesh(mesh_4x2):
        lowered = g.lower(jax.ShapeDtypeStruct((8, 4), jnp.float32), 2)
    compiled = lowered.compile()
    want = NamedSharding(mesh_4x2, P("data", None))
    (x_in,) = jax.tree.leaves(compiled.input_shardings)
    assert x_in.is_equivalent_to(want, 2)
    out, _ = compiled.output_shardings  # the arrays, and the rest (no leaves)
    assert out.is_equivalent_to(want, 2)
    with jax.set_mesh(mesh_4x2):
        shape = g.eval_shape(jax.ShapeDtypeStruct((8, 4), jnp.float32), 2)
    assert shape.shape == (8, 4) and shape.sharding.is_equivalent_to(want, 2)

    class Scaler(eqx.Module):
        w: Float[Array, "a@data b"]

        @jts.filter_jit
        def __call__(self, factor):
            return self.w * factor

    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh_4x2, P("data", None)))
    with jax.set_mesh(mesh_4x2):
        np.testing.assert_array_equal(np.asarray(Scaler(w)(3.0)), 3.0)
        bad = Scaler(jax.device_put(w, NamedSharding(mesh_4x2, P())))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"self\.w"):
            bad(3.0)


def test_module_result_laid_out_as_annotated(mesh_4x2):
    # A module with a stock layer, given as host data and returned: its annotated
    # leaf placed and laid out as annotated, its callable fields passed through.
    class Holder(eqx.Module):
        w: Float[Array, "a@data b"]
        mlp: eqx.nn.MLP

    def scale(m: Holder, s: float) -> Holder:
        return eqx.tree_at(lambda t: t.w, m, m.w * s)

    f = jts.filter_jit(scale, in_shardings="annotations", out_shardings="annotations")
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    with jax.set_mesh(mesh_4x2):
        out = f(Holder(np.ones((8, 4), np.float32), mlp), 2.0)
        out = f(out, 3.0)  # the result goes back in as committed
    want = NamedSharding(mesh_4x2, P("data", None))
    assert out.w.sharding.is_equivalent_to(want, 2)
    assert out.mlp.activation is mlp.activation
    np.testing.assert_array_equal(np.asarray(out.w), 6.0)
