"""Containers in signatures: beartype and typeguard sample `list[T]` and
`dict[str, T]` (documented in docs/guarantees.md); `PyTree[T]` checks every leaf.

The first tests pin the checkers' sampling, so that the documentation is updated if
they ever check every element."""

import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped, PyTree
from typeguard import typechecked

from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, no_transfers, place


A = Float[Array, "b e", P("data", None)]


def _checked(checker, hint):
    if checker == "beartype":

        @jaxtyped(typechecker=beartype)
        def f(xs: hint) -> int:
            return 0

    else:

        @jaxtyped(typechecker=None)
        @typechecked
        def f(xs: hint) -> int:
            return 0

    return f


@pytest.fixture
def arrays(mesh_explicit):
    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    return good, bad


def test_dict_checks_the_first_value_only(checker, arrays):
    good, bad = arrays
    f = _checked(checker, dict[str, A])
    with no_transfers():
        assert f({"a": good, "b": bad}) == 0  # not seen: the documented gap
        with pytest.raises(CHECK_ERRORS):
            f({"a": bad, "b": good})


def test_typeguard_list_checks_the_first_element_only(arrays):
    good, bad = arrays
    f = _checked("typeguard", list[A])
    with no_transfers():
        assert f([good, bad, good]) == 0
        with pytest.raises(CHECK_ERRORS):
            f([bad, good])


def test_beartype_list_samples_one_element(arrays):
    good, bad = arrays
    f = _checked("beartype", list[A])
    outcomes = set()
    for _ in range(64):  # one bad element in 4: missed about 3 times in 4
        try:
            f([good, bad, good, good])
            outcomes.add("passed")
        except CHECK_ERRORS:
            outcomes.add("raised")
    assert "passed" in outcomes


@pytest.mark.parametrize("hint", ["list", "dict"])
def test_pytree_checks_every_leaf(checker, arrays, hint):
    good, bad = arrays
    f = _checked(checker, PyTree[A])
    for position in range(3):
        items = [good, good, good]
        items[position] = bad
        tree = items if hint == "list" else dict(zip("abc", items))
        with no_transfers(), pytest.raises(CHECK_ERRORS):
            f(tree)
    with no_transfers():
        assert f([good, good, good]) == 0
