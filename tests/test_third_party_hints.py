"""A third-party annotation never breaks anything: optax's states (NamedTuples
whose field annotations, `ArrayTree`, do not resolve), `Any` and `optax.OptState`
declare nothing for their subtree. Every function of the library works on such
trees, counts those leaves as unannotated, and still checks what the user's own
annotations declare inside them (the parameters' classes in the moments)."""

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES, place


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@pytest.fixture(autouse=True)
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is the user's to fix
        yield


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "e m@model"]
    b: Float[Array, "m"]  # noqa: F821 - a dim, no sharding


def params(mesh, spec=P(None, "model")):
    return Dense(place(mesh, (4, 8), spec), place(mesh, (8,), P()))


OPTIMIZERS = {
    "sgd+momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "chain(clip, adamw)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "lion": lambda: optax.lion(1e-4),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(1e-3),
}


def test_the_reported_failure(mesh):
    # The issue's own example: plain-dict parameters (nothing annotated at all)
    # and adam's state, through every function; no error and no warning.
    p = {"w": place(mesh, (8, 4), P("data"))}
    opt = optax.adam(1e-3)
    state = opt.init(p)
    out = jts.jit(lambda p, s: s)(p, state)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    derived = jts.jit(
        lambda p, s: s, in_shardings="annotations", out_shardings="annotations"
    )
    with jax.set_mesh(mesh):
        derived(p, state)
        jts.reshard(state)
    # check_tree, asked, checks nothing there and says so (issue 33, item 2):
    # an error by default, which names each leaf; a pass when that is expected.
    with pytest.raises(jts.ShardingTypeCheckError, match=r"none of its 3 array"):
        jts.check_tree(state)
    summary = jts.check_tree(state, summary=True, may_check_nothing=True)
    assert summary.checked == 0 and len(summary.unannotated) == 3
    assert jax.tree.leaves(jts.shardings(state, mesh)) == []  # all None
    assert len(jts.explain(state, mesh).rows) == 3
    jts.sharded_init(opt.init, p, mesh=mesh)
    jts.abstract(opt.init, p, mesh=mesh)
    jts.place(jax.tree.map(np.asarray, state), None, mesh)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_tree_function_works_on_optimiser_state(name, mesh):
    opt = OPTIMIZERS[name]()
    state = opt.init(params(mesh))
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    moments = {jax.tree_util.keystr(k) for k, x in flat if x.shape == (4, 8)}
    others = {jax.tree_util.keystr(k) for k, x in flat if x.shape != (4, 8)}
    summary = jts.check_tree(state, summary=True, name="")
    # The moments hold `Dense`s, whose fields are the user's annotations:
    # checked (`w` and `b`); everything else optax annotates declares nothing.
    assert summary.checked == 2 * len(moments) and moments
    assert set(summary.unannotated) == others
    named = jax.tree_util.tree_flatten_with_path(
        jts.shardings(state, mesh), is_leaf=lambda x: x is None
    )[0]
    for key, sharding in named:
        if jax.tree_util.keystr(key) in moments:
            want = NamedSharding(mesh, P(None, "model"))
            assert sharding.is_equivalent_to(want, 2)
        elif not jax.tree_util.keystr(key).endswith(".b"):
            assert sharding is None
    rows = jts.explain(state, mesh).rows
    assert {r.path for r in rows if r.spec is not None} == moments
    with pytest.raises(jts.ShardingTypeCheckError, match="strict=True"):
        jts.check_tree(state, strict=True)


@pytest.mark.parametrize("name", ["adam", "chain(clip, adamw)", "MultiSteps"])
def test_created_placed_and_laid_out(name, mesh):
    opt = OPTIMIZERS[name]()
    p = params(mesh)
    made = jts.sharded_init(opt.init, p, mesh=mesh)
    target = jts.abstract(opt.init, p, mesh=mesh)
    assert jax.tree.structure(made) == jax.tree.structure(target)
    for leaf, shape in zip(jax.tree.leaves(made), jax.tree.leaves(target)):
        assert leaf.sharding.is_equivalent_to(shape.sharding, leaf.ndim)
        if leaf.shape == (4, 8):  # a moment of `w`: laid out as `Dense.w`
            assert leaf.sharding.is_equivalent_to(
                NamedSharding(mesh, P(None, "model")), 2
            )
        elif leaf.ndim == 0:  # counts: declare nothing, replicated
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    jts.check_tree(made)
    local = jax.tree.map(np.asarray, opt.init(p))
    placed = jts.place(local, None, mesh)
    for leaf, want in zip(jax.tree.leaves(placed), jax.tree.leaves(made)):
        assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim)
    with jax.set_mesh(mesh):
        moved = jts.reshard(opt.init(p))
    jts.check_tree(moved)


def make_step(opt, kind):
    def update(p, state, grads):
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    if kind == "unannotated":

        def train_step(p, state, grads):
            return update(p, state, grads)

    elif kind == "Any":

        def train_step(p: Dense, state: Any, grads: Dense) -> tuple[Dense, Any]:
            return update(p, state, grads)

    else:

        def train_step(
            p: Dense, state: optax.OptState, grads: Dense
        ) -> tuple[Dense, optax.OptState]:
            return update(p, state, grads)

    return train_step


@pytest.mark.parametrize("kind", ["unannotated", "Any", "OptState"])
def test_a_training_step_with_optimiser_state(kind, mesh):
    # Through JAX's caches: warm the step, then a state whose moment is replicated
    # (a new signature): the user's `Dense` annotation inside it is checked.
    opt = optax.adam(1e-3)
    f = jts.jit(make_step(opt, kind))
    p = params(mesh)
    state = opt.init(p)
    _, new_state = f(p, state, p)
    jts.check_tree(new_state)
    bad = (state[0]._replace(mu=params(mesh, P())), *state[1:])
    with pytest.raises(jts.ShardingTypeCheckError, match=r"\[0\]\.mu\.w"):
        f(p, bad, p)
    derived = jts.jit(
        make_step(opt, kind), in_shardings="annotations", out_shardings="annotations"
    )
    host = jax.tree.map(np.asarray, (p, state))
    with jax.set_mesh(mesh):
        new_p, new_state = derived(*host, host[0])
    want = NamedSharding(mesh, P(None, "model"))
    assert new_p.w.sharding.is_equivalent_to(want, 2)
    assert new_state[0].mu.w.sharding.is_equivalent_to(want, 2)
