"""Hints whose shape the value must fit: `tuple[A, B]` by length, `TypedDict` by
keys. A value that does not fit is itself a failure, named by path; a TypedDict
gives its field hints to the dict's keys (required and optional ones)."""

import functools as ft
import itertools
import re
from typing import NotRequired, Optional, TypedDict, Union

import jax
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, MESHES, no_transfers, place


Row = Float[Array, "b@data e"]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


def row(mesh, spec=P("data")):
    return place(mesh, (8, 4), spec)


def _failures(call, *args, **kwargs):
    """The key paths named by the one error of a tree check ({} if it passes):
    `  path: reason` lines, or on Auto axes, for mismatches found when XLA
    compiles, "argument `path` of `f`"."""
    try:
        call(*args, **kwargs)
    except jts.ShardingTypeCheckError as error:
        text = str(error)
        if "while compiling" in text:
            return set(re.findall(r"argument `([^`]+)` of `", text))
        lines = text.splitlines()[1:]
        return {line.split(": ")[0].strip() for line in lines if line.startswith("  ")}
    return set()


# Tuples.


@pytest.mark.parametrize("seed", range(3))
def test_random_tuple_lengths_check_tree_and_jit_agree(seed, mesh):
    # Differential: hint length k, value length n, random bad elements. Same
    # length: exactly the bad elements fail. Another length: the tuple itself
    # fails (it is named, and the hint applies to none of its elements).
    rng = np.random.default_rng(seed)
    for k, n in itertools.product(range(1, 4), range(0, 5)):
        hint = tuple[(Row,) * k]
        bad = rng.random(n) < 0.5
        value = tuple(row(mesh, P() if b else P("data")) for b in bad)
        expected = {f"x[{i}]" for i in range(n) if bad[i]} if k == n else {"x"}
        eager = _failures(jts.check_tree, value, hint, name="x")

        def f(x: hint):  # type: ignore[valid-type]
            return 0

        traced = _failures(jts.jit(f), value)
        assert eager == traced == expected, (k, n, bad)


def test_tuple_length_mismatch_on_both_mesh_kinds(mesh):
    @jts.jit
    def f(pair: tuple[Row, Row]) -> tuple[Row, Row]:
        return pair[0], pair[1]

    f((row(mesh), row(mesh)))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        f((row(mesh), row(mesh), row(mesh)))
    text = str(info.value)
    assert "1 part of the tree does not fit the type hints (0 leaves checked, " in text
    assert "3 array leaves unannotated):" in text  # the hint applied to none
    assert "pair: a tuple of 3 elements, where its type hint" in text

    @jts.jit
    def g(x: Row) -> tuple[Row, Row]:
        return (x,)  # type: ignore[return-value]

    with pytest.raises(jts.ShardingTypeCheckError, match="return: a tuple of 1"):
        g(row(mesh))


def test_a_union_of_tuples_takes_the_member_that_fits(mesh_explicit):
    hint = Union[tuple[Row, Row], tuple[Row, Row, Row]]
    good = row(mesh_explicit)
    jts.check_tree((good, good, good), hint)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\[2\]"):
        jts.check_tree((good, good, row(mesh_explicit, P())), hint)
    assert _failures(jts.check_tree, (good,), hint) == {"tree"}
    jts.check_tree((good,) * 5, tuple[Row, ...])  # variadic: any length


# TypedDict.


class Batch(TypedDict):
    tokens: Row
    mask: NotRequired[Row]


class Extra(Batch, total=False):
    weights: Row


class Loose(TypedDict, total=False):
    tokens: Row


def test_typeddict_fields_are_checked_by_key(mesh):
    good, bad = row(mesh), row(mesh, P())
    jts.check_tree({"tokens": good}, Batch)
    jts.check_tree({"tokens": good, "mask": good, "weights": good}, Extra)
    jts.check_tree({}, Loose)
    cases = {
        ("mask",): ({"tokens": good, "mask": bad}, Batch),
        ("weights",): ({"tokens": good, "weights": bad}, Extra),
        ("missing",): ({"mask": good}, Batch),
        ("extra",): ({"tokens": good, "other": good}, Loose),
    }
    if mesh.axis_types[0] != jax.sharding.AxisType.Explicit:
        cases = {k: v for k, v in cases.items() if k[0] in ("missing", "extra")}
    for (what,), (value, hint) in cases.items():
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
                jts.check_tree(value, hint, name="batch")
            else:
                check = ft.partial(jts.check_tree, annotations=hint, name="batch")
                jts.jit(check)(value)
        text = str(info.value)
        if what == "missing":
            assert (
                "batch: a dict without the required key(s) 'tokens' of `Batch`" in text
            )
        elif what == "extra":
            assert "batch: a dict with the key(s) 'other', which `Loose` lacks" in text
        else:
            assert f"batch['{what}']: this " in text


def test_typeddict_at_the_jit_boundary(mesh):
    @jts.jit
    def f(batch: Batch) -> Row:
        return batch["tokens"]

    f({"tokens": row(mesh)})
    with pytest.raises(jts.ShardingTypeCheckError, match=r"batch\['mask'\]"):
        f({"tokens": row(mesh), "mask": row(mesh, P())})
    with pytest.raises(jts.ShardingTypeCheckError, match="without the required key"):
        f({"mask": row(mesh)})  # type: ignore[typeddict-item]


def _tree_checked(checker, hint):
    if checker == "beartype":

        @jaxtyped(typechecker=beartype)
        def f(batch: jts.Tree[hint]) -> int:  # type: ignore[valid-type]
            return 0

    else:

        @jaxtyped(typechecker=None)
        @typechecked
        def f(batch: jts.Tree[hint]) -> int:  # type: ignore[valid-type]
            return 0

    return f


def test_tree_of_a_typeddict_under_both_checkers(checker, mesh_explicit):
    good, bad = row(mesh_explicit), row(mesh_explicit, P())
    f = _tree_checked(checker, Batch)
    with no_transfers():
        assert f({"tokens": good, "mask": good}) == 0
        assert isinstance({"tokens": good}, jts.Tree[Batch])
        assert not isinstance([good], jts.Tree[Batch])  # not a dict
        for value in ({"tokens": good, "mask": bad}, {"mask": good}):
            with pytest.raises(CHECK_ERRORS):
                f(value)


def test_tree_of_a_typeddict_inside_jit(checker, mesh_auto):
    # Through JAX's caches: warm, a mis-sharded value (a new signature), and the
    # check found when XLA compiles it (Auto axes).
    f = jts.jit(_tree_checked(checker, Batch))
    f({"tokens": row(mesh_auto)})
    with pytest.raises((jts.ShardingTypeCheckError, *CHECK_ERRORS)):
        f({"tokens": row(mesh_auto, P())})


def test_optional_typeddict_in_a_dataclass_like_hint(mesh_explicit):
    good, bad = row(mesh_explicit), row(mesh_explicit, P())
    hint = dict[str, Optional[Batch]]
    jts.check_tree({"a": {"tokens": good}}, hint)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['a'\]\['tokens'\]"):
        jts.check_tree({"a": {"tokens": bad}}, hint)
