"""`check_tree(opt_state, like=params)`: an optax state follows the parameters.

Every subtree of the state with the parameters' structure (the moments) is
checked leaf by leaf as the parameters are laid out; every other leaf (counts,
hyperparameters, adafactor's placeholders) must be replicated; adafactor's
factored statistics are laid out as their parameter without the reduced dim.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES
from .optimisers import Dense, OPTIMISERS


optax = pytest.importorskip("optax")


def _params(mesh):
    with jax.set_mesh(mesh):
        return jts.sharded_init(lambda: Dense(jnp.ones((8, 4)), jnp.zeros(4)))


def _layout(opt, state, params, mesh):
    """`(state placed by the rule, its moments)`, from optax's own reading of
    which leaves of a state hold a parameter (`optax.tree_map_params`, the
    independent oracle): a moment of its parameter's shape is laid out as that
    parameter; every other leaf (counts, hyperparameters, adafactor's factored
    placeholders) replicated; a factored statistic (the parameter's shape
    without one dim) as the parameter's spec without that dim's entry."""
    replicated = NamedSharding(mesh, P())
    moments = []

    def moment(x, p):
        if x.shape != p.shape:
            spec = tuple(p.sharding.spec) + (None,) * (p.ndim - len(p.sharding.spec))
            for k in range(p.ndim):
                if p.shape[:k] + p.shape[k + 1 :] == x.shape:
                    reduced = P(*(spec[:k] + spec[k + 1 :]))
                    moments.append(jax.device_put(x, NamedSharding(mesh, reduced)))
                    return moments[-1]
            return jax.device_put(x, replicated)
        moments.append(jax.device_put(x, p.sharding))
        return moments[-1]

    placed = optax.tree_map_params(
        opt,
        moment,
        state,
        params,
        transform_non_params=lambda x: jax.device_put(x, replicated),
    )
    return placed, moments


def _state(opt, params, mesh):
    with jax.set_mesh(mesh):
        state = jax.jit(opt.init)(params)
    return _layout(opt, state, params, mesh)


@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_state_laid_out_as_the_parameters_passes(name, mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _params(mesh)
    state, _ = _state(OPTIMISERS[name](), params, mesh)
    assert jts.check_tree(state, like=params, name="opt_state") is state
    summary = jts.check_tree(state, like=params, summary=True)
    assert summary.checked == summary.leaves > 0


@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_replicated_moments_are_named_by_path(name, mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _params(mesh)
    opt = OPTIMISERS[name]()
    state, moments = _state(opt, params, mesh)
    replicated = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), state
    )
    assert moments, "every optimiser here keeps at least one moment"
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(replicated, like=params, name="opt_state")
    text = str(info.value)
    # One failure per sharded moment (`w`; `b` on `model` too), each by path.
    failures = [line for line in text.splitlines()[1:] if line.startswith("  opt_")]
    assert len(failures) == len(moments), text
    assert all(line.split(":")[0].endswith((".w", ".b")) for line in failures), text
    if any(m.shape == (8, 4) for m in moments):
        assert "float32[8@data,4@model]" in text


@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
def test_a_sharded_count_is_caught(mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _params(mesh)
    state, _ = _state(optax.adam(1e-3), params, mesh)
    (adam, rest) = state
    count = jax.device_put(jnp.zeros((8,), jnp.int32), NamedSharding(mesh, P("data")))
    bad = (adam._replace(count=count), rest)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.count"):
        jts.check_tree(bad, like=params, name="opt_state")


def test_moments_of_the_wrong_layout_are_caught_inside_jit():
    mesh = MESHES["explicit"]()
    params = _params(mesh)
    state, _ = _state(optax.adam(1e-3), params, mesh)

    @jax.jit
    def step(params, state):
        jts.check_tree(state, like=params, name="opt_state")
        return state

    with jax.set_mesh(mesh):
        step(params, state)  # warm: traced and cached
        wrong = jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, P())), state
        )
        with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.mu\.w"):
            step(params, wrong)  # another layout: traced again, and caught


def test_a_tree_with_no_params_shaped_subtree_is_held_replicated():
    # No moments (`sgd(schedule)`'s count): every leaf replicated, by the rule.
    mesh = MESHES["explicit"]()
    params = _params(mesh)
    other = {"x": jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))}
    assert jts.check_tree(other, like=params) is other
    sharded = {"x": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))}
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['x'\]"):
        jts.check_tree(sharded, like=params)


def test_a_tree_sharing_some_paths_still_names_what_like_lacks():
    mesh = MESHES["explicit"]()
    params = {"w": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))}
    x = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    other = {"w": params["w"], "x": x}
    with pytest.raises(jts.ShardingTypeCheckError, match="structure differs"):
        jts.check_tree(other, like=params)


def test_a_gradient_tree_is_still_matched_by_path():
    mesh = MESHES["explicit"]()
    params = _params(mesh)
    grads = jax.tree.map(jnp.zeros_like, params)
    assert jts.check_tree(grads, like=params) is grads
    bad = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), grads)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"grads\.w|tree\.w"):
        jts.check_tree(bad, like=params)
