"""A tree check says how much it saw: `summary=True`, the counts in its error,
`strict=True` for unannotated array leaves;
and a dataclass JAX cannot see into is named by every function that walks trees,
never passed as one opaque leaf."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES, place


W = Float[Array, "e m@model"]
Norm = Float[Array, "e"]  # checked for dtype and dims; declares no sharding


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: W
    norm: Norm
    extra: jax.Array  # no annotation the library reads


def layer(mesh, w=P(None, "model")):
    return Layer(place(mesh, (4, 8), w), place(mesh, (4,), P()), place(mesh, (3,), P()))


def test_the_tree_comes_back_and_the_summary_on_request(mesh_explicit):
    tree = {"layer": layer(mesh_explicit), "step": 3}
    assert jts.check_tree(tree) is tree  # `x = check_tree(x)` keeps working
    summary = jts.check_tree(tree, summary=True, name="state")
    assert isinstance(summary, jts.TreeSummary) and summary.tree is tree
    assert (summary.leaves, summary.checked) == (4, 2)
    assert summary.unannotated == ("state['layer'].norm", "state['layer'].extra")
    assert str(summary).startswith("2 of 4 leaves checked; array leaves declaring")


def test_the_error_counts_and_holds_the_summary(mesh_explicit):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree([layer(mesh_explicit, P())], name="layers")
    text = str(info.value)
    assert text.startswith(
        "check_tree(layers): 1 of 2 checked leaves do not match their annotation"
    )
    assert "(2 array leaves unannotated):" in text.splitlines()[0]
    assert info.value.summary.checked == 2  # type: ignore[attr-defined]


def test_strict_names_every_unannotated_array_leaf(mesh):
    tree = {"layer": layer(mesh), "count": jnp.zeros((), jnp.int32), "n": 3}
    expected = {"tree['layer'].norm", "tree['layer'].extra", "tree['count']"}

    def named(call):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            call()
        lines = str(info.value).splitlines()
        assert "array leaves declare no sharding (strict=True)" in lines[0]
        return {line.split(": ")[0].strip() for line in lines[1:]}

    if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        assert named(lambda: jts.check_tree(tree, strict=True)) == expected
    # Inside jit, on either mesh kind: the unannotated leaves are known at trace
    # (and the Python int is an array there).
    check = jax.jit(lambda t: jts.check_tree(t, strict=True))
    assert named(lambda: check(tree)) == expected | {"tree['n']"}
    covered = {"layer": {"w": None, "norm": P(), "extra": P()}, "count": P(), "n": None}
    jts.check_tree(tree, covered, strict=True)  # every array leaf declares one
    arrays = {k: v for k, v in tree.items() if k != "n"}
    jts.check_tree(arrays, like=arrays, strict=True)  # like= compares every leaf


def test_a_check_that_checks_nothing_is_not_a_pass(mesh_explicit):
    # Array leaves, none of them checked (issue 33, item 2): an error naming
    # each and why, unless the caller says it is expected; with no warning on
    # the way (an optax state of a plain dict must not break a call by one).
    tree = {"a": place(mesh_explicit, (8, 4), P("data")), "n": 3}
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.check_tree(tree, name="state")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("check_tree(state): its one array leaf is not checked")
    assert lines[1] == "  state['a']: no annotation declares one"
    assert "`may_check_nothing=True`" in lines[-1]
    assert info.value.summary.checked == 0  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jts.check_tree(tree, may_check_nothing=True) is tree
    summary = jts.check_tree(tree, summary=True, may_check_nothing=True)
    assert summary.checked == 0 and summary.unannotated == ("tree['a']",)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['a'\]: declares no"):
        jts.check_tree(tree, strict=True, may_check_nothing=True)
    # Nothing to check is not nothing checked: no array leaves, or one checked
    # (dims only, no sharding) beside unannotated ones, passes as before.
    assert jts.check_tree({"n": 3, "s": "x"}) == {"n": 3, "s": "x"}
    jts.check_tree(tree, {"a": Float[Array, "b e"], "n": None})
    # Inside jit too, on the traced leaves (the int is an array there).
    check = jax.jit(lambda t: jts.check_tree(t, name="t"))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"none of its 2 array"):
        check(tree)
    jax.jit(lambda t: jts.check_tree(t, may_check_nothing=True))(tree)


@pytest.mark.parametrize("seed", range(5))
def test_random_trees_count_what_an_oracle_counts(seed, mesh_explicit):
    # Differential: a random dict of leaves, each annotated with a sharding, with
    # an annotation without one, with nothing, or a non-array leaf; the counts
    # equal those of its construction, and strict fails exactly when one is bare.
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["sharded", "plain", "none", "int"], size=rng.integers(1, 9))
    tree, annotations = {}, {}
    for i, kind in enumerate(kinds):
        key = f"k{i}"
        tree[key] = 7 if kind == "int" else place(mesh_explicit, (8, 4), P("data"))
        annotations[key] = {
            "sharded": Float[Array, "b@data e"],
            "plain": Float[Array, "b e"],
        }.get(kind)
    checked = sum(k in ("sharded", "plain") for k in kinds)
    if not checked and "none" in kinds:  # array leaves, none checked: refused
        with pytest.raises(jts.ShardingTypeCheckError, match="may_check_nothing"):
            jts.check_tree(tree, annotations)
    summary = jts.check_tree(tree, annotations, summary=True, may_check_nothing=True)
    assert summary.checked == checked
    bare = {f"tree['k{i}']" for i, k in enumerate(kinds) if k in ("plain", "none")}
    assert set(summary.unannotated) == bare
    if bare:
        with pytest.raises(jts.ShardingTypeCheckError, match="strict=True"):
            jts.check_tree(tree, annotations, strict=True)
    else:
        jts.check_tree(tree, annotations, strict=True)


def test_the_jit_boundary_counts_unannotated_leaves(mesh):
    @jts.jit
    def f(layer: Layer):
        return layer.w

    with pytest.raises(jts.ShardingTypeCheckError) as info:
        f(layer(mesh, P()))
    head = str(info.value).splitlines()[0]
    if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        assert (
            "1 of 1 checked leaves" in head and "(2 array leaves unannotated)" in head
        )


# Dataclasses JAX does not flatten.


@dataclasses.dataclass
class Plain:  # not registered as a pytree: one leaf to JAX
    w: W


@dataclasses.dataclass
class Config:  # no arrays: a leaf like any other
    lr: float = 0.1


def test_an_unregistered_dataclass_is_named_by_every_walk(mesh_explicit):
    tree = {"plain": Plain(place(mesh_explicit, (4, 8), P(None, "model")))}
    fix = "jax.tree_util.register_dataclass"
    pattern = rf"\['plain'\]: a `.*Plain`, a dataclass that is not registered.*{fix}"
    with pytest.raises(jts.ShardingTypeCheckError, match=pattern):
        jts.check_tree(tree)
    calls = {
        "shardings": lambda: jts.shardings(tree, mesh_explicit),
        "explain": lambda: jts.explain(tree, mesh_explicit),
        "reshard": lambda: jts.reshard(tree, {"plain": None}),
        "place": lambda: jts.place(
            {"plain": Plain(np.ones((4, 8)))}, None, mesh_explicit
        ),
        "sharded_init": lambda: jts.sharded_init(lambda: tree, mesh=mesh_explicit),
        "abstract": lambda: jts.abstract(lambda: tree, mesh=mesh_explicit),
    }
    for name, call in calls.items():
        with pytest.raises((jts.ShardingAnnotationError, TypeError), match=fix) as info:
            call()
        assert "does not fit its type hints" in str(info.value) or name.endswith("init")
    assert not isinstance(tree, jts.Tree[dict[str, W]])

    @jaxtyped(typechecker=beartype)
    def apply(state: jts.Tree[dict]) -> int:
        return 0

    with pytest.raises(Exception) as info:
        apply(tree)
    error, texts = info.value, []
    while error is not None:  # beartype's reason is chained behind jaxtyping's
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    assert "not registered as a pytree" in "\n".join(texts)
    config = {"config": Config(), "w": tree["plain"].w}
    jts.check_tree(config, {"config": None, "w": W})  # no arrays inside: no word
    assert jts.shardings(config, mesh_explicit)["config"] is None


def test_a_registered_dataclass_is_walked(mesh_explicit):
    registered = jax.tree_util.register_dataclass(
        dataclasses.dataclass(type("Reg", (), {"__annotations__": {"w": W}}))
    )
    value = registered(place(mesh_explicit, (4, 8), P()))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.w: "):
        jts.check_tree(value)
    assert jts.shardings(value, mesh_explicit).w == NamedSharding(
        mesh_explicit, P(None, "model")
    )
