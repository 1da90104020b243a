"""`opt_state: jts.Like[" params"]` at the `jts.jit` and `jts.filter_jit`
boundaries follows the same rule as `check_tree(like=)` (issue 33 item 1).

On a representative subset of tests/optimisers.TRANSFORMS (masked,
multi_transform, adafactor, inject_hyperparams, contrib, a state with no
moments), with the parameters declared by a module's fields, by a `tuple[...]`
hint and as one annotated array, on Explicit and Auto meshes: the state optax's
`tree_map_params` lays out passes in and out, and a moment replicated on the way
in, or a state replicated before it is returned, is caught by path. On Auto, the
hint-declared parameters used to let both through (nothing traced there says
their layout; the hint does).
"""

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES
from .optimisers import Dense, NO_MOMENTS, TRANSFORMS
from .test_like_every_path import first_sharded, make_params, oracle, placed


optax = pytest.importorskip("optax")

Matrix = Float[Array, "a b", P("data", "model")]
Vector = Float[Array, "b", P("model")]  # noqa: F821


def _body(opt_state, bad):
    if not bad:
        return opt_state
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.are_all_axes_explicit:
        return jax.tree.map(lambda x: jax.sharding.reshard(x, P()), opt_state)
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())),
        opt_state,
    )


def _steps(bad):
    """One step per style of declaring the parameters."""

    def module(params: Dense, opt_state: jts.Like[" params"]) -> jts.Like[" params"]:
        return _body(opt_state, bad)

    def hinted(
        params: tuple[Matrix, Vector], opt_state: jts.Like[" params"]
    ) -> jts.Like[" params"]:
        return _body(opt_state, bad)

    def array(params: Matrix, opt_state: jts.Like[" params"]) -> jts.Like[" params"]:
        return _body(opt_state, bad)

    return {"module": module, "tuple": hinted, "array": array}


CASES = [
    ("masked", "module", "jit"),
    ("multi_transform", "tuple", "filter_jit"),
    ("adafactor", "module", "filter_jit"),
    ("adafactor", "tuple", "jit"),
    ("inject_hyperparams", "array", "jit"),
    ("contrib_muon", "tuple", "jit"),
    ("adam", "array", "filter_jit"),
    ("sgd_schedule", "module", "jit"),
]
WRAPPERS = {"jit": jts.jit, "filter_jit": jts.filter_jit}


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
@pytest.mark.parametrize(("name", "style", "wrapper"), CASES)
def test_like_params_at_the_boundary_agrees_with_tree_map_params(
    name, style, wrapper, mesh_kind
):
    mesh = MESHES[mesh_kind]()
    params = make_params(style, mesh)
    opt = {**TRANSFORMS, **NO_MOMENTS}[name]()
    with jax.set_mesh(mesh):
        state = opt.init(params)
    want = oracle(opt, state, params)
    good = placed(state, want, mesh)
    wrap = WRAPPERS[wrapper]
    step = wrap(_steps(False)[style])
    with jax.set_mesh(mesh):
        out = step(params, good)
    assert jts.check_tree(out, like=params) is out  # the same rule, eagerly
    if mesh_kind == "explicit":
        got = [x.sharding.spec for x in jax.tree.leaves(out)]
        assert [tuple(g) + (None,) * (len(w) - len(g)) for g, w in zip(got, want)] == [
            tuple(w) + (None,) * (len(g) - len(w)) for g, w in zip(got, want)
        ]
    if name in NO_MOMENTS:
        return  # nothing sharded to plant
    i, path = first_sharded(state, want)

    # A moment replicated on the way in: named by its path.
    leaves, treedef = jax.tree.flatten(good)
    leaves[i] = jax.device_put(leaves[i], NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(params, jax.tree.unflatten(treedef, leaves))
    assert f"opt_state{path}" in str(info.value)

    # The state replicated before it is returned: caught, by path.
    replicating = wrap(_steps(True)[style])
    with jax.set_mesh(mesh):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            replicating(params, good)
    assert path in str(info.value)
