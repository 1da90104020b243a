"""`like=` beyond `check_tree`: `shardings`, `explain`, `sharded_init` and
`abstract` lay an optax state out as the parameters, by the one rule
(`_trees/like.like_layout`), for every optimiser, on Explicit and Auto meshes.

The oracle is optax's own reading of which leaves hold a parameter
(`optax.tree_map_params`), independent of ours.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts
from jaxtyping_shard._drivers.init import sharded_init as _init

from .helpers import MESHES
from .optimisers import Dense, OPTIMISERS


optax = pytest.importorskip("optax")


KINDS = ("explicit", "auto")


def _module_params(mesh):
    with jax.set_mesh(mesh):
        return jts.sharded_init(lambda: Dense(jnp.ones((8, 4)), jnp.zeros(4)))


def _dict_params(mesh):
    # No annotations at all: the layout is read off the arrays.
    return {
        "w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(jnp.zeros(4), NamedSharding(mesh, P("model"))),
    }


PARAMS = {"module": _module_params, "dict": _dict_params}


def expected_specs(opt, params):
    """Per leaf of `opt.init(params)`, the spec the rule gives it, from optax's
    `tree_map_params`: a moment as its parameter, a factored statistic (one dim
    fewer) as its parameter without that dim, anything else replicated."""

    def moment(x, p):
        spec = tuple(p.sharding.spec) + (None,) * (p.ndim - len(p.sharding.spec))
        if x.shape == p.shape:
            return P(*spec)
        for k in range(p.ndim):
            if p.shape[:k] + p.shape[k + 1 :] == x.shape:
                return P(*(spec[:k] + spec[k + 1 :]))
        return P()

    state = jax.eval_shape(opt.init, params)
    return optax.tree_map_params(
        opt, moment, state, params, transform_non_params=lambda x: P()
    )


def _same(mesh, got, want):
    """Leaf by leaf, `got` (shardings, or arrays / structs with one) lays out as
    `want` (specs), by `is_equivalent_to`."""
    got_leaves = jax.tree.leaves(got)
    want_leaves = jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, P))
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves):
        sharding = g if isinstance(g, NamedSharding) else g.sharding
        ndim = len(g.shape) if hasattr(g, "shape") else len(w)
        assert sharding.is_equivalent_to(NamedSharding(mesh, w), ndim), (g, w)


@pytest.mark.parametrize("params_kind", sorted(PARAMS))
@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_shardings_like_params(name, mesh_kind, params_kind):
    mesh = MESHES[mesh_kind]()
    params = PARAMS[params_kind](mesh)
    opt = OPTIMISERS[name]()
    state = jax.eval_shape(opt.init, params)
    got = jts.shardings(state, like=params)
    want = expected_specs(opt, params)
    _same(mesh, got, want)
    # At least one leaf is sharded: the rule is not "replicate everything".
    assert any(s.spec != P() for s in jax.tree.leaves(got))


@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_sharded_init_and_abstract_follow_params(name, mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _module_params(mesh)
    opt = OPTIMISERS[name]()
    want = expected_specs(opt, params)
    with jax.set_mesh(mesh):
        state = jts.sharded_init(opt.init, params)  # `like` found: params
        target = jts.abstract(opt.init, params)
        plain = opt.init(params)
    _same(mesh, state, want)
    _same(mesh, target, want)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target))
    assert jts.check_tree(state, like=params, name="opt_state") is state
    # The values are optax's own.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        assert jnp.array_equal(a, b)


@pytest.mark.parametrize("mesh_kind", KINDS)
def test_sharded_init_like_keyword_and_dict_params(mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _dict_params(mesh)
    opt = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    with jax.set_mesh(mesh):
        state = jts.sharded_init(opt.init, params)
        explicit = jts.sharded_init(opt.init, params, like=params)
        off = jts.sharded_init(opt.init, params, like=False)
    _same(mesh, state, expected_specs(opt, params))
    _same(mesh, explicit, expected_specs(opt, params))
    # like=False: the old rule, unannotated leaves replicated.
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(off))


def test_adafactor_module_params_no_longer_take_field_annotations():
    # Before `like`, the factored stats inside the params-shaped `Dense` took its
    # field annotations and failed on rank ("has 2 dims, but ndim=1").
    mesh = MESHES["explicit"]()
    params = _module_params(mesh)
    opt = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    with jax.set_mesh(mesh):
        with pytest.raises(jts.ShardingAnnotationError, match="v_row"):
            jts.sharded_init(opt.init, params, like=False)
        state = jts.sharded_init(opt.init, params)
    fs = state[0]
    assert fs.v_row.w.sharding.spec == P("model")  # (8,4) reduced over dim 0
    assert fs.v_col.w.sharding.spec == P("data")
    assert fs.v.b.sharding.spec == P("model")
    assert fs.v.w.sharding.spec == P()  # a (1,) placeholder: replicated


@pytest.mark.parametrize("params_kind", sorted(PARAMS))
@pytest.mark.parametrize("mesh_kind", KINDS)
def test_explain_like_params(mesh_kind, params_kind):
    mesh = MESHES[mesh_kind]()
    params = PARAMS[params_kind](mesh)
    state = jax.eval_shape(optax.adam(1e-3).init, params)
    table = jts.explain(state, like=params)
    rows = {r.path.replace("['", ".").replace("']", ""): r for r in table.rows}
    assert rows["[0].mu.w"].spec == P("data", "model")
    assert rows["[0].mu.w"].shard_shape == (2, 2)
    assert rows["[0].nu.b"].spec == P("model")
    assert rows["[0].count"].spec == P()
    assert rows["[0].count"].bytes_replicated == 4 * 7
    assert "float32[8@data,4@model]" in str(table)
    # Moments sharded: nothing of mu/nu is stored twice on the `data` x `model` mesh
    # except the bias over `data`.
    assert rows["[0].mu.w"].bytes_replicated == 0


def test_like_refuses_annotations_and_a_foreign_tree():
    mesh = MESHES["explicit"]()
    params = _module_params(mesh)
    state = jax.eval_shape(optax.adam(1e-3).init, params)
    with pytest.raises(ValueError, match="not both"):
        jts.shardings(state, mesh, like=params, rules={"**": P()})
    with pytest.raises(ValueError, match="not both"):
        jts.explain(state, like=params, annotations=P())
    # A tree sharing some of `like`'s paths is matched by path: `x` is named.
    other = {"w": state[0].mu.w, "x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(jts.ShardingAnnotationError, match=r"tree\['x'\].*structure"):
        jts.shardings(other, mesh, like=params)
    # One sharing none, holding no moment (`sgd(schedule)`): replicated, by rule.
    alone = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    assert jts.shardings(alone, mesh, like=params)["x"].spec == P()


N = 1024


def test_no_device_holds_a_whole_moment():
    # As tests/test_sharded_init_memory.py measures: the compiler's figures for
    # the compiled init, per device. A moment of a 1024x1024 float32 weight is
    # 4 MiB; its shard on 8 devices 512 KiB.
    mesh = MESHES["explicit"]()
    params = {
        "w": jax.device_put(jnp.ones((N, N)), NamedSharding(mesh, P("data", "model")))
    }
    whole = N * N * 4
    for opt in (optax.adam(1e-3), optax.adafactor(1e-3)):
        request = _init.Request(opt.init, (params,), mesh=mesh)
        compiled, run = _init.compile_init(request)
        memory = compiled.memory_analysis()
        per_device = memory.temp_size_in_bytes + memory.output_size_in_bytes
        assert per_device < whole // 2, (opt, per_device)
        state = run()
        for leaf in jax.tree.leaves(state):
            for shard in leaf.addressable_shards:
                assert shard.data.size * 4 < whole // 2


@pytest.mark.parametrize("mesh_kind", KINDS)
def test_the_mesh_is_the_params_own_without_a_context_mesh(mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _dict_params(mesh)
    opt = optax.adam(1e-3)
    state = jts.sharded_init(opt.init, params)  # no `mesh=`, no `jax.set_mesh`
    target = jts.abstract(opt.init, params)
    _same(mesh, state, expected_specs(opt, params))
    _same(mesh, target, expected_specs(opt, params))
    assert state[0].mu["w"].sharding.mesh == mesh
    with pytest.raises(ValueError, match="needs a mesh"):
        jts.sharded_init(lambda k: {"w": jax.random.normal(k, (8,))}, jax.random.key(0))


def test_a_key_placed_on_the_mesh_is_still_an_input():
    # Inputs already on the mesh keep their layout, except PRNG keys (replicated
    # as before). The key whose spec covers its key data's dims, `P(None,)`, that
    # broke this is the one of tests/test_transformer.py (train.py's init).
    mesh = MESHES["explicit"]()
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, P()))
    out = jts.sharded_init(
        lambda k: {"w": jax.random.normal(k, (8, 4))},
        key,
        mesh=mesh,
        annotations={"w": P("data", "model")},
    )
    assert out["w"].sharding.spec == P("data", "model")
