"""A hint that cannot be read never switches off the checks that can be read.

This file uses `from __future__ import annotations`, and `Hidden` exists only
under `TYPE_CHECKING`: every annotation naming it cannot be resolved at run time.
`typing.get_type_hints` fails for the whole function then; the library reads each
parameter on its own, warns once per function (or class) naming the one it
cannot read, and checks and derives from the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import textwrap
import warnings
from collections.abc import Iterable
from typing import Any, NotRequired, TYPE_CHECKING, TypedDict, Union

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES, place


if TYPE_CHECKING:
    from somewhere_else import Hidden  # noqa: F401


Row = Float[Array, "b@data e"]
W = Float[Array, "e m@model"]
Logical = Float[Array, "batch embed", jts.Logical]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: W


def rows(mesh, spec=P("data")):
    return {"a": place(mesh, (8, 4), spec)}


def dense(mesh, spec=P(None, "model")):
    return Dense(place(mesh, (4, 8), spec))


def _step():
    # A fresh function each time: the warning is once per function.
    def step(table: dict[str, Row], opt: Hidden, model: Dense) -> dict[str, Row]:
        return {"a": table["a"] + model.w.sum()}

    return step


def test_one_unreadable_parameter_leaves_the_others_checked(mesh):
    f = jts.jit(_step())
    with pytest.warns(
        jts.ShardingWarning, match=r"parameter `opt` of `.*step`.*Hidden"
    ):
        f(rows(mesh), {"x": 1.0}, dense(mesh))
    # Warm, then a mis-sharded table (a new signature): caught, by path. On Auto
    # axes it is found when XLA compiles that signature.
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        f(rows(mesh, P()), {"x": 1.0}, dense(mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w"):
        f(rows(mesh), {"x": 1.0}, dense(mesh, P()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per function
        f(rows(mesh), {"x": 2.0}, dense(mesh))
    with jts.set_mode("off"):
        f(rows(mesh, P()), {"x": 1.0}, dense(mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        f(rows(mesh, P()), {"x": 1.0}, dense(mesh))  # mode back on: checked again


def test_derived_shardings_keep_the_readable_parameters(mesh):
    f = jts.jit(_step(), in_shardings="annotations", out_shardings="annotations")
    args = ({"a": np.ones((8, 4), np.float32)}, {"x": np.float32(1)})
    args += (Dense(np.ones((4, 8), np.float32)),)
    with jax.set_mesh(mesh):
        with pytest.warns(jts.ShardingWarning, match="`opt`"):
            out = f(*args)
        ins = f.lower(*args).compile().input_shardings[0]
    want = NamedSharding(mesh, P("data", None))
    assert out["a"].sharding.is_equivalent_to(want, 2)
    assert ins[0]["a"].is_equivalent_to(want, 2)
    assert ins[2].w.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)


def test_one_reading_shared_by_jit_and_place_for(mesh_explicit):
    step = _step()
    with pytest.warns(jts.ShardingWarning) as record:
        jts.jit(step)(rows(mesh_explicit), {}, dense(mesh_explicit))
        table = jts.place_for(step, "table", {"a": np.ones((8, 4))}, mesh_explicit)
        with pytest.raises(
            jts.ShardingAnnotationError, match=r"place_for: .*parameter `opt`.*Hidden"
        ):
            jts.place_for(step, "opt", np.ones(3), mesh_explicit)
    assert len(record) == 1  # one function, one warning, whoever reads it
    assert table["a"].sharding.spec == P("data", None)


def test_typed_shard_map_names_the_parameter_it_cannot_read(mesh_explicit):
    def body(x: Row, y: Hidden) -> Row:
        return x

    with pytest.warns(jts.ShardingWarning):
        with pytest.raises(jts.ShardingAnnotationError, match=r"parameter `y`.*Hidden"):
            jts.typed_shard_map(body, mesh=mesh_explicit)


def test_the_return_annotation_alone_unreadable(mesh_explicit):
    def f(table: dict[str, Row]) -> Hidden:
        return table

    jitted = jts.jit(f)
    with pytest.warns(jts.ShardingWarning, match="return annotation of"):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
            jitted(rows(mesh_explicit, P()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HalfReadable:
    table: dict[str, Row]
    opt: Hidden
    more: list[Hidden]


def test_a_users_class_warns_once_and_reads_its_other_fields(mesh_explicit):
    value = HalfReadable(
        rows(mesh_explicit, P()), {"m": place(mesh_explicit, (8,), P())}, []
    )
    with pytest.warns(jts.ShardingWarning, match=r"field `opt` of .*HalfReadable"):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"value\.table\['a'\]"):
            jts.check_tree(value, name="value")
    good = HalfReadable(rows(mesh_explicit), value.opt, [])
    summary = jts.check_tree(good, summary=True)  # no second warning
    assert summary.checked == 1 and summary.unannotated == ("tree.opt['m']",)
    assert "Hidden" in summary.notes["tree.opt['m']"]
    with pytest.raises(
        jts.ShardingTypeCheckError, match=r"opt\['m'\]: .*strict.*Hidden"
    ):
        jts.check_tree(good, strict=True)


def test_through_the_caches_a_change_of_rules_is_checked(mesh):
    # The readable parameter is logical: warm a trace under one rules table,
    # change the table, call again with the same arrays: checked anew.
    def f(x: dict[str, Logical], opt: Hidden):
        return x["a"] * 2

    jitted = jts.jit(f)
    x = rows(mesh)  # laid out as `batch` on `data`
    with jts.axis_rules({"batch": "data", "embed": None}):
        with pytest.warns(jts.ShardingWarning, match="`opt`"):
            jitted(x, None)
        jitted(x, None)
    with jts.axis_rules({"batch": "model", "embed": None}):
        with pytest.raises(jts.ShardingTypeCheckError, match=r"x\['a'\]"):
            jitted(x, None)
        jitted(rows(mesh, P("model")), None)


class Batch(TypedDict):  # string annotations here: `NotRequired` inside them
    tokens: Row
    mask: NotRequired[Row]
    extra: NotRequired[Hidden]


def test_a_typeddict_under_future_annotations(mesh_explicit):
    # Python's `__required_keys__` cannot see `NotRequired` inside the strings of
    # `from __future__ import annotations`; the resolved hints say it. `extra`
    # cannot be read: it declares nothing, and the class is named once.
    good, bad = rows(mesh_explicit)["a"], rows(mesh_explicit, P())["a"]
    with pytest.warns(jts.ShardingWarning, match=r"field `extra` of .*Batch"):
        jts.check_tree({"tokens": good}, Batch)
    jts.check_tree({"tokens": good, "extra": bad}, Batch)
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\['mask'\]"):
        jts.check_tree({"tokens": good, "mask": bad}, Batch)
    with pytest.raises(jts.ShardingTypeCheckError, match="required key.*'tokens'"):
        jts.check_tree({"mask": good}, Batch)


# An alias of another module's kind: it resolves, but holds a forward reference
# that does not (optax's `ArrayTree`). The user wrote `Nested`, which exists.
Nested = Union[jax.Array, Iterable["NotDefinedHere"]]  # noqa: F821


def test_a_forward_reference_inside_an_alias_declares_nothing_silently(mesh_explicit):
    def f(state: Nested, table: dict[str, Row]):
        return table

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jts.jit(f)((place(mesh_explicit, (8,), P()),), rows(mesh_explicit))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        jts.jit(f)((), rows(mesh_explicit, P()))


_SOURCE = """
from __future__ import annotations
import dataclasses
import jax
from typing import TYPE_CHECKING
from jaxtyping import Array
from jaxtyping_shard import Float
if TYPE_CHECKING:
    from elsewhere import Missing

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    sharded: Float[Array, "e m@model"]
    plain: Float[Array, "e m"]
    hidden: Missing
"""


def _import(tmp_path, folder, name, monkeypatch):
    root = tmp_path / folder
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(_SOURCE))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


def test_whose_class_it_is_decides_what_is_said(tmp_path, monkeypatch, mesh_explicit):
    # The same class, defined in the user's code and in an installed package
    # (a file under site-packages): the user's warns about `hidden` and checks
    # `plain`'s dims; the third party's says nothing and reads only what declares
    # a sharding. Both check `sharded`, and neither raises over `hidden`.
    mine = _import(tmp_path, "src", "trees_a_mine", monkeypatch)
    theirs = _import(
        tmp_path, "lib/python3/site-packages", "trees_a_theirs", monkeypatch
    )
    for module, is_users in ((mine, True), (theirs, False)):
        good = place(mesh_explicit, (4, 8), P(None, "model"))
        value = module.State(good, place(mesh_explicit, (4, 3, 2), P()), good)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if is_users:  # `plain` has 3 dims, not 2: the user's annotation says so
                with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.plain"):
                    jts.check_tree(value)
            else:
                summary = jts.check_tree(value, summary=True)
                assert summary.checked == 1
                assert set(summary.unannotated) == {"tree.plain", "tree.hidden"}
        said = [str(w.message) for w in record]
        assert bool(said) == is_users, said
        assert not said or "field `hidden` of `trees_a_mine.State`" in said[0]
        bad = module.State(place(mesh_explicit, (4, 8), P()), value.plain, good)
        with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.sharded"):
            jts.check_tree(bad)

    # A user's class extending the library's: the fields the library defines
    # are the library's (silent, sharded ones only); its own field is the user's.
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Mine(theirs.State):
        extra: dict[str, Row]

    good = place(mesh_explicit, (4, 8), P(None, "model"))
    value = Mine(good, place(mesh_explicit, (4, 3, 2), P()), good, rows(mesh_explicit))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jts.check_tree(value, summary=True).checked == 2
    with pytest.raises(jts.ShardingTypeCheckError, match=r"tree\.extra\['a'\]"):
        jts.check_tree(Mine(good, value.plain, good, rows(mesh_explicit, P())))


@pytest.mark.parametrize("seed", range(4))
def test_random_signatures_check_exactly_the_readable_parameters(seed, mesh):
    # Differential: a random signature whose parameters are annotated with
    # readable hints, hints naming `Hidden`, `Any` or an alias with a dangling
    # reference, against the same function with only the readable hints. Both
    # must find exactly the mis-sharded values under readable hints.
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["row", "hidden", "hidden_in", "any", "nested"], size=5)
    text = {
        "row": "dict[str, Row]",
        "hidden": "Hidden",
        "hidden_in": "dict[str, Hidden]",
        "any": "Any",
        "nested": "Nested",
    }
    params = ", ".join(f"p{i}: {text[k]}" for i, k in enumerate(kinds))
    oracle = ", ".join(
        f"p{i}: {text[k]}" if k == "row" else f"p{i}" for i, k in enumerate(kinds)
    )
    scope = {"Row": Row, "Any": Any, "Nested": Nested, "__name__": __name__}
    code = "def f({}):\n    return 0\ndef g({}):\n    return 0\n"
    flags = annotations.compiler_flag  # the `from __future__` above binds it
    exec(compile(code.format(params, oracle), "<random>", "exec", flags), scope)
    tested, reference = jts.jit(scope["f"]), jts.jit(scope["g"])
    hidden = any(k.startswith("hidden") for k in kinds)
    with pytest.warns(jts.ShardingWarning) if hidden else contextlib.nullcontext():
        tested(*[rows(mesh) for _ in kinds])
    for _ in range(4):
        bad = rng.random(len(kinds)) < 0.4
        args = [rows(mesh, P() if b else P("data")) for b in bad]
        expected = {f"p{i}['a']" for i, k in enumerate(kinds) if bad[i] and k == "row"}
        assert _failing(tested, args) == _failing(reference, args) == expected


def _failing(f, args):
    try:
        f(*args)
    except jts.ShardingTypeCheckError as error:
        text = str(error)
        if "while compiling" in text:  # Auto axes: found when XLA compiles
            return set(re.findall(r"argument `([^`]+)` of `", text))
        lines = text.splitlines()[1:]
        return {line.split(":")[0].strip() for line in lines if line.startswith("  ")}
    return set()
