"""Stacked layers on every path, in both spellings: `stacked={pattern: n}` on the
call, or `jts.Stacked[Block, n]` on the field, declared once (issue 23, item 3).

Each test runs on the Explicit, Auto and mixed meshes and with each spelling:
`sharded_init` / `abstract` build the stack, `check_tree`, `shardings`,
`explain`, `reshard` and `jts.jit` (boundary checks and
`in_shardings="annotations"`, a `jax.lax.scan` over the layers) read it; a
stacked leaf replicated where it should be sharded, a layer not stacked and one
stacked twice are mismatches named by path, the rank ones saying `stacked=`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


LAYERS = 4


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


class Block(eqx.Module):
    w: Float[Array, "embed mlp", P(None, "model")]
    b: Float[Array, "mlp", P("model")]  # noqa: F821

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 4))
        self.b = jnp.zeros(4)


def _layers(key):
    return eqx.filter_vmap(Block)(jax.random.split(key, LAYERS))


class Plain(eqx.Module):  # the stack declared by each call's `stacked=`
    blocks: Block

    def __init__(self, key):
        self.blocks = _layers(key)


@jaxtyped(typechecker=beartype)  # beartype reads `Stacked[Block]` as `Block`
class Hinted(eqx.Module):  # declared once, on the field
    blocks: jts.Stacked[Block]

    def __init__(self, key):
        self.blocks = _layers(key)


class Piped(eqx.Module):  # the stacked dim sharded over "data"
    blocks: jts.Stacked[Block, ("data",)]  # noqa: F821

    def __init__(self, key):
        self.blocks = _layers(key)


# spelling: (model class, the `stacked=` each call passes, w's full spec)
SPELLINGS = {
    "keyword": (Plain, {"stacked": {"**/blocks/**": 1}}, P(None, None, "model")),
    "hint": (Hinted, {}, P(None, None, "model")),
    "keyword-piped": (
        Plain,
        {"stacked": {"**/blocks/**": ("data",)}},
        P("data", None, "model"),
    ),
    "hint-piped": (Piped, {}, P("data", None, "model")),
}


@pytest.fixture(params=list(SPELLINGS))
def spelled(request):
    return SPELLINGS[request.param]


def _spec_is(x, spec):
    return x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), x.ndim)


def _b_spec(w_spec):
    return P(w_spec[0], "model")


def _with_w(model, w):
    return eqx.tree_at(lambda m: m.blocks.w, model, w)


def test_sharded_init_abstract_check_shardings_explain(mesh, spelled):
    cls, kw, spec = spelled
    model = jts.sharded_init(cls, jax.random.key(0), mesh=mesh, **kw)
    assert model.blocks.w.shape == (LAYERS, 8, 4)
    assert _spec_is(model.blocks.w, spec)
    assert _spec_is(model.blocks.b, _b_spec(spec))
    target = jts.abstract(cls, jax.random.key(0), mesh=mesh, **kw)
    assert target.blocks.w.sharding.spec == spec
    assert jts.check_tree(target, **kw) is target
    assert jts.check_tree(model, **kw) is model
    summary = jts.check_tree(model, summary=True, **kw)
    assert (summary.checked, summary.unannotated) == (2, ())
    shardings = jts.shardings(model, mesh, **kw)
    assert shardings.blocks.w.spec == spec
    assert shardings.blocks.b.spec == _b_spec(spec)
    rows = {row.path: row for row in jts.explain(model, mesh, **kw).rows}
    assert rows[".blocks.w"].spec == spec
    assert rows[".blocks.w"].dims.startswith("[stack] ")
    assert rows[".blocks.w"].shard_shape[0] == (1 if spec[0] == "data" else LAYERS)


def test_mismatches_named_by_path_saying_stacked(mesh, spelled):
    cls, kw, spec = spelled
    model = jts.sharded_init(cls, jax.random.key(0), mesh=mesh, **kw)
    w = model.blocks.w
    replicated = _with_w(model, jax.device_put(w, NamedSharding(mesh, P())))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(replicated, name="model", **kw)
    text = str(info.value)
    assert "model.blocks.w" in text and "model.blocks.b" not in text
    assert "1 of 2 checked" in text
    whole = jax.device_put(w, NamedSharding(mesh, P()))  # indexed, restacked
    layer = jax.device_put(whole[0], NamedSharding(mesh, P(None, "model")))
    flat = _with_w(model, layer)
    doubled = jnp.stack([whole, whole])
    twice = _with_w(model, jax.device_put(doubled, NamedSharding(mesh, P(None, *spec))))
    for bad, rank in ((flat, 2), (twice, 4)):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            jts.check_tree(bad, name="model", **kw)
        text = str(info.value)
        assert f"model.blocks.w: rank {rank}" in text
        assert "stacked=" in text and "model.blocks.b" not in text
    assert "jts.Stacked[Block, 2]" in str(info.value)  # stacked twice: 2 dims


def test_unstacked_model_says_stacked_on_every_path(mesh):
    model = jts.sharded_init(
        Plain, jax.random.key(0), mesh=mesh, stacked={"blocks/**": 1}
    )
    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"(?s)model.blocks.w.*stacked="
    ):
        jts.check_tree(model, name="model")
    with pytest.raises(jts.ShardingTypeCheckError, match="jts.Stacked"):
        jts.check_tree(model)
    for call in (
        lambda: jts.sharded_init(Plain, jax.random.key(0), mesh=mesh),
        lambda: jts.shardings(model, mesh),
        lambda: jts.explain(model, mesh),
        lambda: jts.reshard(model),
    ):
        with pytest.raises(jts.ShardingAnnotationError) as info:
            call()
        assert "stacked=" in str(info.value) and "jts.Stacked" in str(info.value)

    @jts.jit
    def f(model: Plain) -> Plain:
        return model

    with jax.set_mesh(mesh), pytest.raises(jts.ShardingTypeCheckError) as info:
        f(model)
    assert "model.blocks.w" in str(info.value) and "stacked=" in str(info.value)


def test_reshard_lays_the_stack_out(mesh, spelled):
    cls, kw, spec = spelled
    model = jts.sharded_init(cls, jax.random.key(0), mesh=mesh, **kw)
    moved = jax.device_put(model, NamedSharding(mesh, P()))
    assert not _spec_is(moved.blocks.w, spec)
    back = jts.reshard(moved, **kw)
    assert _spec_is(back.blocks.w, spec)
    assert _spec_is(back.blocks.b, _b_spec(spec))
    with jax.set_mesh(mesh):
        inside = jax.jit(lambda m: jts.reshard(m, **kw))(moved)
    assert _spec_is(inside.blocks.w, spec)
    jts.check_tree(inside, **kw)


def _step(cls, spec):
    def step(
        model: cls, x: Float[Array, "batch embed", P("data", None)]
    ) -> tuple[cls, Float[Array, "batch embed", P("data", None)]]:
        def layer(h, block):
            return h * jnp.mean(block.w) + jnp.mean(block.b), None

        if spec[0] is None:
            h, _ = jax.lax.scan(layer, x, model.blocks)
        else:  # JAX scans only over a replicated leading dim: a pipeline's own
            h, _ = layer(x, model.blocks)
        return model, h

    return step


def test_jit_annotation_shardings_scan_over_the_stack(mesh, spelled):
    cls, kw, spec = spelled
    model = jts.sharded_init(cls, jax.random.key(0), mesh=mesh, **kw)
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    step = jts.jit(
        _step(cls, spec), in_shardings="annotations", out_shardings="annotations", **kw
    )
    with jax.set_mesh(mesh):
        out, h = step(model, x)
        assert _spec_is(out.blocks.w, spec) and _spec_is(h, P("data", None))
        lowered = step.lower(model, x)
        assert lowered.args_info[0][0].blocks.w._aval.shape == (LAYERS, 8, 4)
        out, _ = step(out, x)  # warm: JAX's cache
        # A stack replicated where it is sharded: a committed argument refused.
        bad = _with_w(model, jax.device_put(model.blocks.w, NamedSharding(mesh, P())))
        with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.blocks\.w"):
            step(bad, x)
        out, _ = step(out, x)  # and the good stack still runs
    assert _spec_is(out.blocks.w, spec)
    # reshard_inputs=True moves it instead, to the stacked layout.
    moving = jts.jit(
        _step(cls, spec), in_shardings="annotations", reshard_inputs=True, **kw
    )
    with jax.set_mesh(mesh):
        out, _ = moving(bad, x)
    assert _spec_is(out.blocks.w, spec)


def test_jit_boundary_checks_the_stack_through_caches(mesh, spelled):
    cls, kw, spec = spelled
    model = jts.sharded_init(cls, jax.random.key(0), mesh=mesh, **kw)
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    step = jts.jit(_step(cls, spec), **kw)
    with jax.set_mesh(mesh):
        step(model, x)
        step(model, x)  # warm
        bad = _with_w(model, jax.device_put(model.blocks.w, NamedSharding(mesh, P())))
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(bad, x)
        assert "model.blocks.w" in str(info.value)
        step(model, x)  # the good one again, from the cache
        filtered = jts.filter_jit(_step(cls, spec), **kw)
        filtered(model, x)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.blocks\.w"):
            filtered(bad, x)
