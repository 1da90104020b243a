"""A tree that declares nothing is not a pass (issue 33, item 2).

An Orbax restore without a target gives plain dicts in the saved layout. Where
a module class is declared, such a value cannot be the hint: an error by path
at every boundary (`check_tree`, `Tree[...]`, `jts.jit`, `jts.filter_jit`, the
functions that lay a tree out). A `check_tree` that finds array leaves and
checks none of them raises, naming them and why, unless the caller says so
(`may_check_nothing=True`). `jts.jit` on unannotated arguments still checks
nothing and says nothing; third-party annotations still never raise.
"""

import dataclasses
import warnings
from typing import NamedTuple, Optional, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES, place


ocp = pytest.importorskip("orbax.checkpoint")

W = Float[Array, "e m@model"]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: W
    b: Float[Array, "m"]  # noqa: F821 - dims only


class Block(eqx.Module):
    w: W


class Pair(NamedTuple):
    w: W


class HasW(Protocol):  # not runtime-checkable: `isinstance` refuses it
    w: W


def dense(mesh, spec=P(None, "model")):
    return Dense(place(mesh, (4, 8), spec), place(mesh, (8,), P()))


@pytest.fixture(scope="module")
def restored_as_dicts(tmp_path_factory):
    """A `Dense` saved with Orbax and restored without a target: plain dicts,
    each leaf in the saved layout (here: replicated, which `Dense.w` forbids)."""
    mesh = MESHES["explicit"]()
    path = tmp_path_factory.mktemp("ckpt") / "dense"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, dense(mesh, P()))
        checkpointer.wait_until_finished()
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path)
    assert type(restored) is dict and set(restored) == {"w", "b"}
    return restored


def _lines(call):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        call()
    return str(info.value).splitlines()


def test_a_restore_without_target_is_refused_by_check_tree(restored_as_dicts):
    lines = _lines(lambda: jts.check_tree(restored_as_dicts, name="params"))
    assert lines[0].startswith("check_tree(params): none of its 2 array leaves is")
    assert set(lines[1:3]) == {
        "  params['w']: no annotation declares one",
        "  params['b']: no annotation declares one",
    }
    assert "may_check_nothing=True" in lines[-1]
    # The class declared for it: the dict cannot be one, named at its path.
    lines = _lines(lambda: jts.check_tree(restored_as_dicts, Dense, name="params"))
    assert "1 part of the tree does not fit" in lines[0]
    assert lines[1].startswith(
        "  params: a dict where its type hint declares the class "
        "`tests.test_nothing_declared.Dense`"
    )
    assert not isinstance(restored_as_dicts, jts.Tree[Dense])
    assert isinstance(dense(MESHES["explicit"]()), jts.Tree[Dense])


def test_every_boundary_refuses_a_dict_for_a_module_class(restored_as_dicts, mesh):
    # Through JAX's caches: warm the step with the class, then the restored
    # dicts (a new signature): named by path, on either mesh kind.
    good = dense(mesh)
    restored = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, x.sharding.spec)),
        restored_as_dicts,
    )

    def step(params: Dense) -> Array:
        return jnp.sum(params.w)

    derived = {"in_shardings": "annotations", "out_shardings": "annotations"}
    for wrap in (jts.jit, jts.filter_jit, lambda f: jts.jit(f, **derived)):
        f = wrap(step)
        with jax.set_mesh(mesh):
            f(good)
            with pytest.raises(jts.ShardingTypeCheckError) as info:
                f(restored)
        text = str(info.value)
        assert "arguments: 1 part of the tree does not fit" in text
        assert "\n  params: a dict where its type hint declares the class" in text
    for lay_out in (
        lambda: jts.shardings(restored, mesh, annotations=Dense),
        lambda: jts.explain(restored, mesh, annotations=Dense),
    ):
        with pytest.raises(jts.ShardingAnnotationError, match="a dict where its"):
            lay_out()


@pytest.mark.parametrize("kind", ["dataclass", "equinox", "namedtuple"])
def test_each_kind_of_class_and_the_values_it_accepts(kind, mesh_explicit):
    cls = {"dataclass": Dense, "equinox": Block, "namedtuple": Pair}[kind]
    w = place(mesh_explicit, (4, 8), P(None, "model"))
    value = Dense(w, w[0]) if kind == "dataclass" else cls(w)
    jts.check_tree(value, cls)  # an instance: its fields apply
    wrong = {"w": w} if kind != "namedtuple" else (w,)  # a tuple for a NamedTuple
    lines = _lines(lambda: jts.check_tree(wrong, cls))
    assert f"where its type hint declares the class `{cls.__module__}" in lines[1]
    # No false alarm: None under Optional, a subclass, a Protocol, bare containers.
    jts.check_tree(None, Optional[cls])
    if kind == "equinox":

        class Wider(Block):
            extra: int = 0

        jts.check_tree(Wider(w), Block)
    jts.check_tree({"w": w}, HasW, may_check_nothing=True)
    jts.check_tree({"w": w}, dict, may_check_nothing=True)
    jts.check_tree({"w": w}, dict[str, W])


def test_unannotated_arguments_still_say_nothing(mesh):
    # Plain dicts, an optax state, no annotations: jts.jit checks nothing and
    # says nothing; a third party's annotations (optax.OptState) never raise.
    p = {"w": place(mesh, (8, 4), P("data"))}
    opt = optax.adam(1e-3)
    state = opt.init(p)

    def plain(p, s):
        return s

    def typed(p: dict, s: optax.OptState) -> optax.OptState:
        return s

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f in (plain, typed):
            jts.jit(f)(p, state)
            jts.filter_jit(f)(p, state)
    # check_tree, asked to check the bare state, says it checked nothing; with
    # `like=` its moments are declared (laid out as the parameters): checked.
    lines = _lines(lambda: jts.check_tree(state, name="opt_state"))
    assert lines[0].startswith("check_tree(opt_state): none of its 3 array leaves")
    assert jts.check_tree(state, may_check_nothing=True) is state
    summary = jts.check_tree(state, like=p, summary=True)
    assert summary.checked == 3


def test_a_hint_that_cannot_be_read_is_the_reason_given(mesh_explicit):
    # Metadata it cannot read: the unread annotation is named as the reason.
    source = (
        "from __future__ import annotations\n"
        "import dataclasses, jax\n"
        "@jax.tree_util.register_dataclass\n"
        "@dataclasses.dataclass\n"
        "class Opaque:\n"
        "    w: NotDefinedAnywhere\n"
    )
    scope: dict = {"__name__": __name__}
    exec(compile(source, "<opaque>", "exec"), scope)
    value = scope["Opaque"](place(mesh_explicit, (4, 8), P()))
    with pytest.warns(jts.ShardingWarning, match="NotDefinedAnywhere"):
        lines = _lines(lambda: jts.check_tree(value, name="v"))
    assert lines[1].startswith("  v.w: the annotation of field `w` of")
    assert "NotDefinedAnywhere" in lines[1]


def test_random_trees_refused_exactly_when_nothing_is_checked(mesh_explicit):
    # Differential: random dicts of annotated, unannotated and non-array
    # leaves; refused iff some leaf is an array and none is checked.
    rng = np.random.default_rng(0)
    x = place(mesh_explicit, (8, 4), P("data"))
    for _ in range(12):
        kinds = rng.choice(["sharded", "bare", "int"], size=rng.integers(1, 5))
        tree = {f"k{i}": 3 if k == "int" else x for i, k in enumerate(kinds)}
        hints = {f"k{i}": Float[Array, "b@data e"] if k == "sharded" else None
                 for i, k in enumerate(kinds)}  # fmt: skip
        refused = "bare" in kinds and "sharded" not in kinds
        try:
            jts.check_tree(tree, hints)
            raised = False
        except jts.ShardingTypeCheckError as error:
            raised = "may_check_nothing" in str(error)
        assert raised == refused, kinds
        jts.check_tree(tree, hints, may_check_nothing=True)
