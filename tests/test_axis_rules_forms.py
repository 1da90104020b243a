"""The program's own rules (issue 34, item 4): every form a rules table takes
(mapping, pairs, Flax Linen's and NNX's rules, a dataclass, a NamedTuple), and a
per-call `axis_rules=` on every function of the library, meaning what the same
table means under `with jts.axis_rules(...)`, through JAX's caches."""

import dataclasses
import functools as ft
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._layout.resolve import resolve
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS


W = Float[Array, "embed mlp", jts.Logical]
Tree = dict[str, W]
TABLE = {"embed": "data", "mlp": "model", "batch": None}  # A
OTHER = {"embed": None, "mlp": "model", "batch": None}  # B: embed replicated


@dataclasses.dataclass(frozen=True)
class Rules:  # a program's own rules, as its config holds them
    embed: Any = "data"
    mlp: Any = "model"
    batch: Any = None


class RulesTuple(NamedTuple):
    embed: Any = "data"
    mlp: Any = "model"
    batch: Any = None


PAIRS = [("embed", "data"), ("mlp", "model"), ("batch", None)]


def _spec(rules, shape=(8, 4)):
    entries = resolve(W._jts, shape, None, jts.AxisRules(rules))
    return P(*(e[0] if len(e) == 1 else e or None for e in entries))


# -- the forms -------------------------------------------------------------------


def test_each_form_gives_the_same_table():
    from flax import linen as nn, nnx

    with nn.logical_axis_rules(PAIRS):
        linen = nn.get_logical_axis_rules()
    from flax.core.spmd import get_logical_axis_rules

    with nnx.logical_axis_rules(tuple(PAIRS)):
        from_nnx = get_logical_axis_rules()
        with nnx.use_eager_sharding(False):
            param = nnx.Param(jnp.zeros((8, 4)), out_sharding=("embed", "mlp"))
        nnx_spec = nnx.get_partition_spec(param).get_value()
    mapping = jts.AxisRules(TABLE)
    # A dataclass or NamedTuple is the dict of its fields (dim by dim).
    assert jts.AxisRules(Rules()) == jts.AxisRules(RulesTuple()) == mapping
    assert jts.AxisRules(dataclasses.asdict(Rules())) == mapping
    # Flax's rules (Linen's and NNX's context alike) and MaxText's YAML lists
    # are pairs, read in Linen's order of priority.
    yaml = [[n, a] for n, a in PAIRS]
    assert jts.AxisRules(linen) == jts.AxisRules(from_nnx) == jts.AxisRules(yaml)
    assert jts.AxisRules(linen).linen and not mapping.linen
    # Every form resolves alike, as Flax Linen does.
    forms = [TABLE, Rules(), RulesTuple(), PAIRS, linen, from_nnx, yaml]
    assert {_spec(f) for f in forms} == {P("data", "model")}
    assert nn.logical_to_mesh_axes(("embed", "mlp"), linen) == P("data", "model")
    assert nnx_spec == P("data", "model")
    # The scope and flax_rules take every form too.
    for form in forms:
        with jts.axis_rules(form) as parsed:
            assert jts.get_axis_rules() == parsed
        assert dict(jts.flax_rules(form)) == dict(PAIRS)
    # A field value means what a dict value means: a tuple is several axes, a
    # list fallbacks, jts.fsdp(...) FSDP.
    several = jts.AxisRules(Rules(embed=("data", "model"), mlp=["model", None]))
    assert several.candidates("embed") == (("data", "model"),)
    assert several.candidates("mlp") == (("model",), ())
    assert jts.AxisRules(RulesTuple(embed=jts.fsdp("data"))).gathered == {"embed"}


@pytest.mark.parametrize(
    "rules, match",
    [
        (Rules(embed=3), r"axis rule 'embed' \(field Rules\.embed\) is 3, which is "),
        (RulesTuple(mlp=("x", "x")), r"'mlp' \(field RulesTuple\.mlp\) names a mesh"),
        (Rules(batch=[]), r"'batch' \(field Rules\.batch\): an empty fallback list"),
        (Rules(mlp=[["a"]]), r"field Rules\.mlp\): candidate 0 is a list"),
        (Rules, r"not type .*Rules.* \(a dataclass class: pass an instance of it\)"),
        (3, r"a dataclass instance or NamedTuple with one field per logical name"),
        ([("embed", "a", "b")], r"entry 0: .* is not a \(name, mesh_axes\) pair"),
    ],
)
def test_malformed_forms_name_the_field(rules, match):
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        jts.AxisRules(rules)
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        jts.check_tree({}, axis_rules=rules)
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        jts.jit(lambda x: x, axis_rules=rules)  # refused when wrapping


# -- every function takes axis_rules= ---------------------------------------------

FUNCTIONS = [
    "check_tree", "shardings", "explain", "sharded_init", "abstract", "place",
    "jit", "filter_jit", "preflight", "collectives",
]  # fmt: skip


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_function_declares_the_keyword(name):
    parameter = inspect.signature(getattr(jts, name)).parameters["axis_rules"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default is None
    doc = getattr(jts, name).__doc__
    assert "`axis_rules`" in doc or "**Arguments:** as for [`jax" in doc


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return make_mesh((4, 2), ("data", "model"), request.param)


def _tree(mesh, spec, shape=(8, 4)):
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    return {"w": jax.device_put(x, NamedSharding(mesh, spec))}


def _same(call, rules):
    """`call(axis_rules=rules)`, and `call()` under `with jts.axis_rules(rules)`:
    the same value, or the same error (type and message)."""
    outcomes = []
    for run in (
        lambda: call(axis_rules=rules),
        lambda: _under(rules, call),
    ):
        try:
            outcomes.append(("ok", run()))
        except Exception as error:  # noqa: BLE001 - compared below
            outcomes.append((type(error), str(error)))
    assert outcomes[0] == outcomes[1], outcomes
    return outcomes[0]


def _under(rules, call):
    with jts.axis_rules(rules):
        return call()


def test_check_tree_shardings_explain(mesh):
    tree = _tree(mesh, P("data", "model"))
    check = lambda **kw: jts.check_tree(tree, {"w": W}, **kw) is tree  # noqa: E731
    assert _same(check, Rules()) == ("ok", True)
    kind, message = _same(check, OTHER)  # the planted mismatch, by key path
    assert issubclass(kind, CHECK_ERRORS) and "tree['w']" in message
    assert "P(None, 'model')" in message or "8,4@model" in message

    specs = lambda **kw: jts.shardings(tree, mesh, annotations={"w": W}, **kw)  # noqa: E731
    assert _same(specs, RulesTuple())[1]["w"].spec == P("data", "model")
    assert _same(specs, OTHER)[1]["w"].spec == P(None, "model")
    kind, message = _same(specs, {"embed": "data"})  # no rule for `mlp`
    assert kind is jts.ShardingAnnotationError and "'mlp'" in message

    table = lambda **kw: str(jts.explain(tree, mesh, annotations={"w": W}, **kw))  # noqa: E731
    assert _same(table, PAIRS)[1] != _same(table, OTHER)[1]
    assert "data" in _same(table, PAIRS)[1]
    kind, message = _same(table, {"embed": "fsdp", "mlp": None})  # not the mesh's
    assert kind is jts.ShardingAnnotationError and "'fsdp'" in message


def test_sharded_init_abstract_place(mesh):
    def init(shape=(8, 4)):
        return {"w": jnp.ones(shape)}

    def made(f, shape, **kw):
        return f(init, shape, mesh=mesh, annotations={"w": W}, **kw)["w"].sharding

    for f in (jts.abstract, jts.sharded_init):
        fits, uneven = ft.partial(made, f, (8, 4)), ft.partial(made, f, (6, 4))
        assert _same(fits, Rules())[1].spec == P("data", "model")
        assert _same(uneven, OTHER)[1].spec == P(None, "model")
        # 6 rows do not split over data=4: refused under A, by key path.
        kind, message = _same(uneven, Rules())
        assert kind is jts.ShardingAnnotationError and "['w']" in message

    local = {"w": np.ones((8, 4), np.float32)}
    put = lambda **kw: jts.place(local, {"w": W}, mesh, **kw)["w"].sharding  # noqa: E731
    assert _same(put, RulesTuple())[1].spec == P("data", "model")
    assert _same(put, OTHER)[1].spec == P(None, "model")
    kind, message = _same(put, {"embed": "data", "mlp": "data"})  # data twice
    assert kind is jts.ShardingAnnotationError and "both resolve" in message


def _step(p: Tree) -> Tree:
    return {"w": p["w"] * 2}


def test_jit_and_filter_jit_rules_at_wrap_time(mesh):
    ok, wrong = _tree(mesh, P("data", "model")), _tree(mesh, P(None, "model"))
    for make in (jts.jit, jts.filter_jit):
        under_a = make(_step, axis_rules=Rules())
        under_b = make(_step, axis_rules=OTHER)
        for _ in range(3):  # warm: JAX's C++ fast path
            assert under_a(ok)["w"].sharding.spec == P("data", "model")
        with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
            under_b(ok)  # the same function, the same input, table B
        assert under_b(wrong)["w"].sharding.spec == P(None, "model")
        assert under_a(ok)["w"].sharding.spec == P("data", "model")  # back to A
        with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
            under_a(wrong)
        # The table given when wrapping is the inner scope: an outer `with`
        # does not change it, as a nested `with` would not.
        with jts.axis_rules(OTHER):
            assert under_a(ok)["w"].sharding.spec == P("data", "model")
            assert jts.get_axis_rules() == jts.AxisRules(OTHER)
        # The stages run under it too.
        with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
            under_b.lower(ok).compile()  # Auto axes: checked when compiled
        assert under_a.lower(ok).compile() is not None
    # jts.jit's decorator form, and its `.trace`.
    decorated = jts.jit(axis_rules=OTHER)(_step)
    with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
        decorated.trace(ok).lower().compile()  # resolved when traced, under B
    assert decorated(wrong)["w"].sharding.spec == P(None, "model")


def test_a_per_call_table_through_one_jit_cache(mesh):
    # One jitted step, warmed under table A and reported on under B: its checks
    # follow each call's table (JAX's caches are keyed on it), and back to A.
    step = jts.jit(_step)
    ok = _tree(mesh, P("data", "model"))
    for _ in range(2):
        assert jts.collectives(step, ok, axis_rules=Rules()).count == 0
    with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
        jts.collectives(step, ok, axis_rules=OTHER)
    with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
        with jts.axis_rules(OTHER):
            jts.collectives(step, ok)
    assert jts.collectives(step, ok, axis_rules=PAIRS).count == 0
    # Its calls through JAX's C++ dispatch, warm under A, then B, then A.
    with jts.axis_rules(TABLE):
        for _ in range(3):
            assert step(ok)["w"].sharding.spec == P("data", "model")
    with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
        jts.collectives(step, ok, axis_rules=OTHER)
    with pytest.raises(CHECK_ERRORS, match=r"p\['w'\]"):
        with jts.axis_rules(OTHER):
            step(ok)
    with jts.axis_rules(TABLE):
        assert step(ok)["w"].sharding.spec == P("data", "model")

    check_mesh = mesh if mesh.axis_types[0] == jax.sharding.AxisType.Auto else None

    def report(**kw):
        return str(jts.preflight(step, ok, mesh=mesh, check_mesh=check_mesh, **kw))

    assert _same(report, Rules())[0] == "ok"
    kind, message = _same(report, OTHER)
    assert kind is jts.ShardingTypeCheckError and "p['w']" in message
    assert _same(report, RulesTuple())[0] == "ok"  # back to A
    # A step wrapped with its own table keeps it (the inner scope) in
    # preflight and collectives, whatever the call's table.
    own = jts.jit(_step, axis_rules=Rules())
    assert jts.preflight(own, ok, mesh=mesh, check_mesh=check_mesh, axis_rules=OTHER)
    assert jts.collectives(own, ok, axis_rules=OTHER).count == 0
    with pytest.raises(jts.ShardingTypeCheckError, match=r"p\['w'\]"):
        jts.preflight(jts.jit(_step, axis_rules=OTHER), ok, mesh=mesh,
                      check_mesh=check_mesh)  # fmt: skip


def test_per_call_rules_nest_as_with_blocks(mesh):
    ok = _tree(mesh, P("data", "model"))
    a, b = jts.AxisRules(TABLE), jts.AxisRules(OTHER)
    seen = []

    def record(tree):
        seen.append(jts.get_axis_rules())
        return tree

    traced = jts.jit(record)
    with jts.axis_rules(b):
        # The call's table replaces the outer one inside the call, and the outer
        # one is back after it, as `with axis_rules(b): with axis_rules(a):`.
        jts.check_tree(ok, {"w": W}, axis_rules=a)
        assert jts.get_axis_rules() == b
        with pytest.raises(CHECK_ERRORS):
            jts.check_tree(ok, {"w": W})
        # None: not given, the rules in force.
        with pytest.raises(CHECK_ERRORS):
            jts.check_tree(ok, {"w": W}, axis_rules=None)
        jts.jit(record, axis_rules=a)(ok)
        traced(ok)
    with jts.set_axis_rules(b):  # the process default, under every scope
        jts.check_tree(ok, {"w": W}, axis_rules=a)
        assert jts.get_axis_rules() == b
    assert seen == [a, b] and jts.get_axis_rules() is None
    assert str(jts.jit(_step, axis_rules=a)).endswith(f"under axis rules {a!r}>")


def test_a_method_keeps_its_rules(mesh):
    import equinox as eqx

    class Model(eqx.Module):
        w: W

        @jts.filter_jit(axis_rules=OTHER)
        def ruled(self, x: W) -> W:
            return self.w + x

    model = Model(_tree(mesh, P("data", "model"))["w"])
    with jts.axis_rules(TABLE):
        with pytest.raises(CHECK_ERRORS, match=r"self\.w"):
            model.ruled(model.w)  # bound to the instance, under its own table
