"""The optimiser state's one layout rule, the same on every path (issue 33 item 1).

Differential: for every optax transformation that keeps per-parameter state
(`optimisers.TRANSFORMS`, masked, multi_transform and contrib included), on
Explicit and Auto meshes, with the parameters as a module's annotated fields, as
a tuple (laid out by their arrays here; by a `tuple[...]` hint at the `jit`
boundary in tests/test_like_every_boundary.py) and as one array, every eager path
(`check_tree`, `shardings`, `explain` with `like=`, `abstract(opt.init, params)`
of concrete and of abstract parameters) lays the state out as optax's own
`tree_map_params` says (the oracle), and a planted wrong layout is caught by
path. `sharded_init` (the one path that compiles; it lays out what `abstract`
planned) runs on a representative subset.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxtyping_shard as jts

from .helpers import MESHES
from .optimisers import Dense, NO_MOMENTS, OUTSIDE_THE_ORACLE, TRANSFORMS


optax = pytest.importorskip("optax")
KINDS = ["explicit", "auto"]


def make_params(style, mesh):
    """The parameters, placed on `mesh`: a module, a tuple, or one array (made
    once per mesh: they are only read)."""
    key = (mesh, style)
    if key not in _PARAMS:
        w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
        b = jax.device_put(jnp.zeros(4), NamedSharding(mesh, P("model")))
        _PARAMS[key] = {"module": Dense(w, b), "tuple": (w, b), "array": w}[style]
    return _PARAMS[key]


_PARAMS: dict = {}


STYLES = ["module", "tuple", "array"]


def is_masked(x):
    return isinstance(x, optax.MaskedNode)


def oracle(opt, state, params):
    """Per array leaf of `state`, its spec by optax's reading of which leaves hold
    a parameter (`tree_map_params`): a moment as its parameter, a statistic with
    one dim fewer as its parameter without that dim, anything else replicated."""

    def moment(x, p):
        if is_masked(x):
            return x  # a masked-out parameter: no leaf
        spec = tuple(p.sharding.spec) + (None,) * (p.ndim - len(p.sharding.spec))
        if x.shape == p.shape:
            return P(*spec)
        for k in range(p.ndim):
            if p.shape[:k] + p.shape[k + 1 :] == x.shape:
                return P(*(spec[:k] + spec[k + 1 :]))
        return P()

    specs = optax.tree_map_params(
        opt,
        moment,
        state,
        params,
        transform_non_params=lambda x: P() if hasattr(x, "shape") else None,
        is_leaf=is_masked,
    )
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def leaf_specs(tree):
    """The spec of each array leaf (array, struct or sharding) of `tree`."""
    out = []
    for leaf in jax.tree.leaves(tree):
        sharding = leaf if isinstance(leaf, NamedSharding) else leaf.sharding
        out.append(sharding.spec)
    return out


def same(mesh, got, want, shapes):
    """`got` (specs) lays out as `want`, leaf by leaf (trailing `None`s aside)."""
    assert len(got) == len(want) == len(shapes) > 0
    for g, w, shape in zip(got, want, shapes):
        a, b = NamedSharding(mesh, g), NamedSharding(mesh, w)
        assert a.is_equivalent_to(b, len(shape)), (g, w, shape)


def placed(state, specs, mesh):
    leaves, treedef = jax.tree.flatten(state)
    out = jax.device_put(leaves, [NamedSharding(mesh, s) for s in specs])
    return jax.tree.unflatten(treedef, out)


def described(state, specs, mesh):
    """`state` as structs laid out by `specs` (a check reads no data)."""
    leaves, treedef = jax.tree.flatten(state)
    out = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
        for x, s in zip(leaves, specs)
    ]
    return jax.tree.unflatten(treedef, out)


def first_sharded(state, specs):
    """`(index, key path)` of the first leaf the oracle shards."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    for i, spec in enumerate(specs):
        if any(e is not None for e in spec):
            return i, jax.tree_util.keystr(paths[i])
    raise AssertionError("the oracle shards no leaf")


def abstract_params(params, mesh):
    """`params` as structs on the mesh's `AbstractMesh` (the preflight path)."""
    on = mesh.abstract_mesh

    def one(x):
        sharding = NamedSharding(on, x.sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, params)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_eager_path_agrees_with_tree_map_params(name, mesh_kind, style):
    mesh = MESHES[mesh_kind]()
    params = make_params(style, mesh)
    opt = TRANSFORMS[name]()
    state = jax.eval_shape(opt.init, params)
    want = oracle(opt, state, params)
    shapes = [x.shape for x in jax.tree.leaves(state)]
    assert any(s != P() for s in want), "the transformation keeps a moment"

    # shardings(like=) and explain(like=), on the abstract state.
    same(mesh, leaf_specs(jts.shardings(state, mesh, like=params)), want, shapes)
    rows = jts.explain(state, like=params).rows
    same(mesh, [r.spec for r in rows], want, shapes)
    # abstract(opt.init, ...): of the placed parameters, and of their structs on
    # an AbstractMesh (no devices: the preflight path).
    with jax.set_mesh(mesh):
        got = jts.abstract(opt.init, params)
    same(mesh, leaf_specs(got), want, shapes)
    got = jts.abstract(opt.init, abstract_params(params, mesh))
    same(mesh, leaf_specs(got), want, shapes)

    # check_tree(like=): the state laid out by the oracle passes, every leaf
    # checked; one moment replicated instead is named by its path (structs:
    # concrete states are checked in test_like_optimiser_state.py and at the
    # boundary in test_like_every_boundary.py).
    summary = jts.check_tree(described(state, want, mesh), like=params, summary=True)
    assert summary.checked == summary.leaves == len(want)
    i, path = first_sharded(state, want)
    wrong = list(want)
    wrong[i] = P()
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(described(state, wrong, mesh), like=params, name="opt_state")
    failures = [ln for ln in str(info.value).splitlines() if ln.startswith("  opt_")]
    assert [ln.split(":")[0].strip() for ln in failures] == [f"opt_state{path}"]


def state_values(opt, params):
    """`opt.init(params)` on zeros of the parameters' shapes (no mesh needed)."""
    return opt.init(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params))


# `sharded_init` lays out what `abstract` planned (`_drivers/init/plan.py`, the
# same code): compiled on a representative subset, each style in turn.
COMPILED = [
    ("masked", "module"),
    ("multi_transform", "tuple"),
    ("contrib_muon", "array"),
    ("adafactor", "tuple"),
    ("inject_hyperparams", "array"),
    ("adamw", "module"),
]


@pytest.mark.parametrize("mesh_kind", KINDS)
def test_sharded_init_agrees_with_tree_map_params(mesh_kind):
    mesh = MESHES[mesh_kind]()
    for name, style in COMPILED:
        params = make_params(style, mesh)
        opt = TRANSFORMS[name]()
        with jax.set_mesh(mesh):
            state = jts.sharded_init(opt.init, params)  # `like`: the parameters
            plain = opt.init(params)
        want = oracle(opt, state, params)
        shapes = [x.shape for x in jax.tree.leaves(state)]
        same(mesh, leaf_specs(state), want, shapes)
        # optax's own values, only laid out.
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
            assert jnp.array_equal(a, b), name


@pytest.mark.parametrize("mesh_kind", KINDS)
@pytest.mark.parametrize("name", sorted(NO_MOMENTS))
def test_a_state_with_no_moments_is_replicated_on_every_path(name, mesh_kind):
    mesh = MESHES[mesh_kind]()
    params = make_params("module", mesh)
    opt = NO_MOMENTS[name]()
    state = jax.eval_shape(opt.init, params)
    want = oracle(opt, state, params)
    assert want and all(s == P() for s in want)
    shapes = [x.shape for x in jax.tree.leaves(state)]
    same(mesh, leaf_specs(jts.shardings(state, mesh, like=params)), want, shapes)
    with jax.set_mesh(mesh):
        same(mesh, leaf_specs(jts.abstract(opt.init, params)), want, shapes)
    concrete = placed(state_values(opt, params), want, mesh)
    assert jts.check_tree(concrete, like=params) is concrete
    # A leaf of it sharded is caught, by path.
    leaves, treedef = jax.tree.flatten(concrete)
    k = max(range(len(leaves)), key=lambda j: leaves[j].ndim)
    if leaves[k].ndim == 0 or leaves[k].shape[0] % 4:
        leaves[k] = jnp.zeros((8,), jnp.int32)  # one a mesh axis can split
    leaves[k] = jax.device_put(leaves[k], NamedSharding(mesh, P("data")))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"opt_state\["):
        jts.check_tree(
            jax.tree.unflatten(treedef, leaves), like=params, name="opt_state"
        )


def test_a_masked_node_may_stand_for_a_whole_subtree():
    # `optax.masked` with a mask that is a prefix of the parameters: one
    # MaskedNode in place of the whole `enc` subtree.
    mesh = MESHES["explicit"]()
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
    params = {"enc": {"w": w, "v": w}, "dec": {"w": w}}
    opt = optax.masked(optax.adam(1e-3), {"enc": False, "dec": True})
    state = jax.eval_shape(opt.init, params)
    assert is_masked(state.inner_state[0].mu["enc"])
    want = oracle(opt, state, params)
    shapes = [x.shape for x in jax.tree.leaves(state)]
    same(mesh, leaf_specs(jts.shardings(state, mesh, like=params)), want, shapes)
    assert jts.shardings(state, mesh, like=params).inner_state[0].mu["dec"][
        "w"
    ].spec == P("data", "model")


@pytest.mark.parametrize("name", sorted(OUTSIDE_THE_ORACLE))
def test_the_transformations_left_out_are_those_the_oracle_cannot_read(name):
    # Their state is not laid out per parameter: `tree_map_params` fails on it.
    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    opt = OUTSIDE_THE_ORACLE[name]()
    state = opt.init(params)
    with pytest.raises((ValueError, TypeError, IndexError)):
        optax.tree_map_params(opt, lambda x, p: x, state, params)


def test_there_are_enough_transformations():
    assert len(TRANSFORMS) >= 25
    for kind in ("masked", "multi_transform", "contrib_muon", "adafactor"):
        assert kind in TRANSFORMS
