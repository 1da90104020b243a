"""`jts.Like["params"]`: an optimiser state laid out as the parameters, checked at
the `jts.jit` / `jts.filter_jit` boundary by key path and used for the derived
shardings, for every optimiser, on Explicit and Auto meshes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import jaxtyped

import jaxtyping_shard as jts

from .helpers import MESHES
from .optimisers import Dense  # the class of the parameters `_module_params` makes
from .test_like_init import _module_params, expected_specs, OPTIMISERS


optax = pytest.importorskip("optax")

KINDS = ("explicit", "auto")
DERIVED = {"in_shardings": "annotations", "out_shardings": "annotations"}


def _replicate(tree, mesh, kind):
    """Every leaf replicated inside a trace, as a careless step would."""
    if kind == "explicit":
        return jax.tree.map(lambda x: jax.sharding.reshard(x, P()), tree)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def _step(opt, mesh_kind, derived=False, bad=False):
    def step(
        params: Dense,
        opt_state: jts.Like["params"],  # noqa: F821
    ) -> tuple[Dense, jts.Like["params"]]:  # noqa: F821
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        if bad:
            opt_state = _replicate(opt_state, None, mesh_kind)
        return optax.apply_updates(params, updates), opt_state

    return jts.jit(step, **DERIVED) if derived else jts.jit(step)


def _setup(name, mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = _module_params(mesh)
    opt = OPTIMISERS[name]()
    with jax.set_mesh(mesh):
        state = jts.sharded_init(opt.init, params)
    return mesh, params, opt, state


def _laid_out(mesh, tree, want):
    leaves = jax.tree.leaves(tree)
    specs = jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(specs) > 0
    for x, spec in zip(leaves, specs):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x, spec)


@pytest.mark.parametrize("derived", [False, True], ids=["checked", "derived"])
@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_a_step_keeps_the_state_laid_out_as_params(name, mesh_kind, derived):
    mesh, params, opt, state = _setup(name, mesh_kind)
    step = _step(opt, mesh_kind, derived)
    with jax.set_mesh(mesh):
        new_params, new_state = step(params, state)
        new_params, new_state = step(new_params, new_state)  # warm
    _laid_out(mesh, new_state, expected_specs(opt, params))
    assert jts.check_tree(new_state, like=params) is new_state


@pytest.mark.parametrize("derived", [False, True], ids=["checked", "derived"])
@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_a_state_replicated_inside_the_step_is_named_by_path(name, mesh_kind, derived):
    mesh, params, opt, state = _setup(name, mesh_kind)
    step = _step(opt, mesh_kind, derived, bad=True)
    with jax.set_mesh(mesh):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(params, state)
    text = str(info.value)
    assert "return value" in text or "return[1]" in text, text
    # The first moment of the weight, by its path in the result.
    assert "return[1]" in text and ".w" in text, text
    assert "count" not in text  # replicated counts are right


@pytest.mark.parametrize("mesh_kind", KINDS)
def test_a_mis_sharded_state_argument_is_caught_through_the_caches(mesh_kind):
    mesh, params, opt, state = _setup("adam", mesh_kind)
    step = _step(opt, mesh_kind)
    replicated = jax.device_put(state, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        step(params, state)  # warm: traced, compiled, cached
        step(params, state)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.mu\.w"):
            step(params, replicated)
        _, again = step(params, state)  # the good layout still runs
    _laid_out(mesh, again, expected_specs(opt, params))


def test_derived_shardings_place_an_uncommitted_state():
    # in_shardings="annotations" places a NumPy state as the rule says.
    mesh, params, opt, state = _setup("adafactor", "explicit")
    host = jax.tree.map(np.asarray, state)
    step = _step(opt, "explicit", derived=True)
    with jax.set_mesh(mesh):
        compiled = step.lower(params, host).compile()
        _, new_state = step(params, host)
    in_state = compiled.input_shardings[0][1]
    want = expected_specs(opt, params)
    got = jax.tree.leaves(in_state, is_leaf=lambda x: x is None)
    specs = jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, P))
    assert len(got) == len(specs)
    sharded = [(s, spec) for s, spec in zip(got, specs) if spec != P()]
    assert len(sharded) == 3  # v_row.w, v_col.w (factored), v.b, and no other
    for s, spec in sharded:  # a replicated leaf's sharding may be left to JAX
        assert s.spec == spec
    _laid_out(mesh, new_state, want)


def test_unannotated_params_on_explicit_follow_their_arrays():
    mesh = MESHES["explicit"]()
    params = {
        "w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
    }
    opt = optax.adam(1e-3)

    @jts.jit
    def step(params: dict, opt_state: jts.Like["params"]) -> jts.Like["params"]:  # noqa: F821
        return opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)[1]

    with jax.set_mesh(mesh):
        state = jts.sharded_init(opt.init, params)
        assert state[0].mu["w"].sharding.spec == P("data", "model")
        step(params, state)
        with pytest.raises(
            jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.nu\['w'\]"
        ):
            step(params, jax.device_put(state, NamedSharding(mesh, P())))


@pytest.mark.parametrize("derived", [False, True], ids=["checked", "derived"])
@pytest.mark.parametrize("mesh_kind", KINDS)
def test_filter_jit_checks_like(mesh_kind, derived):
    mesh, params, opt, state = _setup("adam", mesh_kind)

    def step(params: Dense, opt_state: jts.Like["params"], lr: float):  # noqa: F821
        return jax.tree.map(lambda x: x * lr, opt_state)

    step = jts.filter_jit(step, **DERIVED) if derived else jts.filter_jit(step)

    with jax.set_mesh(mesh):
        step(params, state, 0.5)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\[0\]\.mu\.w"):
            step(params, jax.device_put(state, NamedSharding(mesh, P())), 0.5)


@pytest.mark.parametrize("bad", [3, "", "a b", None])
def test_malformed_like_fails_when_written(bad):
    with pytest.raises(jts.ShardingAnnotationError, match="name of another parameter"):
        jts.Like[bad]


def test_unknown_or_own_name_fails_at_the_first_call():
    mesh, params, opt, state = _setup("adam", "explicit")

    @jts.jit
    def typo(params: Dense, opt_state: jts.Like["parms"]):  # noqa: F821
        return opt_state

    @jts.jit
    def itself(params: Dense, opt_state: jts.Like["opt_state"]):  # noqa: F821
        return opt_state

    @jts.jit
    def result(params: Dense, opt_state) -> jts.Like["nothing"]:  # noqa: F821
        return opt_state

    with jax.set_mesh(mesh):
        with pytest.raises(
            jts.ShardingAnnotationError,
            match=r"typo.*'opt_state'.*no parameter 'parms'.*params, opt_state",
        ):
            typo(params, state)
        with pytest.raises(jts.ShardingAnnotationError, match="its own name"):
            itself(params, state)
        with pytest.raises(jts.ShardingAnnotationError, match="the return value"):
            result(params, state)


def test_a_leading_space_is_the_same_name():
    # The lint-clean spelling (no F821), as jaxtyping's `" batch"`.
    assert jts.Like[" params"] == jts.Like["params"]


def test_beartype_and_jaxtyped_check_nothing_there():
    @jaxtyped(typechecker=beartype)
    def f(params: dict, opt_state: jts.Like["params"]) -> jts.Like["params"]:  # noqa: F821
        return opt_state

    assert f({}, (1, "anything")) == (1, "anything")
    with pytest.raises(TypeError):
        jts.Like()


def test_unannotated_params_on_auto_leave_like_unchecked_but_derive_it():
    # Inside the trace the layout of an unannotated parameter over Auto axes is
    # not known: its moments declare nothing at the boundary (no error), while
    # the derived shardings read it off the concrete argument.
    mesh = MESHES["auto"]()
    params = {
        "w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
    }
    opt = optax.adam(1e-3)

    def step(params: dict, opt_state: jts.Like["params"]) -> jts.Like["params"]:  # noqa: F821
        return opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)[1]

    with jax.set_mesh(mesh):
        state = jts.sharded_init(opt.init, params)
        jts.jit(step)(params, jax.device_put(state, NamedSharding(mesh, P())))
        new = jts.jit(step, **DERIVED)(params, state)
    assert new[0].mu["w"].sharding.spec == P("data", "model")


@pytest.mark.parametrize("mesh_kind", KINDS)
def test_each_wrong_leaf_is_named_and_only_those(mesh_kind):
    # mu.w on the wrong axes, a count sharded: two failures, by path, with the
    # expected layout; nu and the rest pass.
    mesh, params, opt, state = _setup("adam", mesh_kind)
    adam, rest = state
    swapped = jax.device_put(adam.mu.w, NamedSharding(mesh, P("model", "data")))
    count = jax.device_put(jnp.zeros((8,), jnp.int32), NamedSharding(mesh, P("data")))
    bad = (
        adam._replace(count=count, mu=eqx.tree_at(lambda m: m.w, adam.mu, swapped)),
        rest,
    )

    @jts.jit
    def step(params: Dense, opt_state: jts.Like["params"]):  # noqa: F821
        return opt_state

    with jax.set_mesh(mesh):
        step(params, state)  # warm
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(params, bad)
    text = str(info.value)
    assert "opt_state[0].mu.w" in text and "opt_state[0].count" in text, text
    assert "opt_state[0].nu" not in text and "mu.b" not in text, text
    assert "P('data', 'model')" in text or "8@data,4@model" in text, text
