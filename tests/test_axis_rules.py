"""Rules tables: parsing, scoping, Linen lists, and swapping them through caches."""

import asyncio
import threading

import jax
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._layout.resolve import resolve
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS, no_transfers, place


def _spec(annotation, shape, rules, mesh=None):
    entries = resolve(annotation._jts, shape, mesh, jts.AxisRules(rules))
    return P(*(e[0] if len(e) == 1 else e or None for e in entries))


# -- parsing -------------------------------------------------------------------


def test_forms_and_equality():
    a = jts.AxisRules({"batch": "data", "embed": ("fsdp", "x"), "mlp": None})
    assert a.candidates("batch") == (("data",),)
    assert a.candidates("embed") == (("fsdp", "x"),)
    assert a.candidates("mlp") == ((),)
    assert a.candidates("vocab") is None
    assert a == jts.AxisRules({"batch": "data", "embed": ("fsdp", "x"), "mlp": None})
    assert hash(a) == hash(jts.AxisRules(a))
    assert a != jts.AxisRules(a, conflicts="first")
    assert jts.AxisRules({"e": ["fsdp", None]}).candidates("e") == (("fsdp",), ())
    assert repr(jts.AxisRules({"e": ["a", None]}, conflicts="first")) == (
        "AxisRules({'e': ['a', None]} (conflicts='first'))"
    )
    with pytest.raises(AttributeError):
        a.conflicts = "first"  # type: ignore[misc]


def test_linen_list_reads_lists_as_several_axes():
    linen = jts.AxisRules([("batch", ["data", "fsdp"]), ("batch", "data")])
    assert linen.linen
    assert linen.candidates("batch") == (("data", "fsdp"), ("data",))
    assert repr(linen) == "AxisRules([('batch', ('data', 'fsdp')), ('batch', 'data')])"


@pytest.mark.parametrize(
    "rules, kwargs, match",
    [
        ("embed", {}, r"must be a dict .* or a list of \(name, mesh_axes\) pairs"),
        ({"embed": 3}, {}, r"axis rule 'embed' is 3, which is not a mesh axis"),
        ({"embed": ("a", "a")}, {}, r"names a mesh axis twice"),
        ({"embed": []}, {}, r"an empty fallback list"),
        ({"embed": [["a", "b"]]}, {}, r"candidate 0 is a list; .* as a tuple"),
        ({"embed": ("a", "")}, {}, r"holds '', which is not a mesh axis name"),
        ({3: "a"}, {}, r"the logical name 3 is not a non-empty string"),
        ([("embed",)], {}, r"entry 0: \('embed',\) is not a \(name, mesh_axes\) pair"),
        ({"embed": "a"}, {"conflicts": "last"}, r"conflicts='last' is not a conflict"),
    ],
)
def test_malformed_tables(rules, kwargs, match):
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        jts.AxisRules(rules, **kwargs)
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        with jts.axis_rules(rules, **kwargs):
            pass


# -- resolution semantics -------------------------------------------------------


def test_linen_priority_is_rule_order_dict_is_dim_order():
    A = Float[Array, "features batch", jts.Logical]
    # Linen: the earlier *rule* wins the axis.
    linen = [("batch", "x"), ("features", "x")]
    assert _spec(A, (8, 8), jts.AxisRules(linen, conflicts="first")) == P(None, "x")
    # A dict: the earlier *dim* wins it.
    table = {"batch": "x", "features": "x"}
    assert _spec(A, (8, 8), jts.AxisRules(table, conflicts="first")) == P("x", None)


def test_linen_docstring_example():
    # Flax's `logical_to_mesh_axes` docstring: P('X', None, 'Y', None). Linen
    # replicates `length` silently; here it needs a rule (None), and `features`
    # losing 'X' to `batch` needs conflicts='first'.
    A = Float[Array, "batch length heads features", jts.Logical]
    rules = [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")]
    first = jts.AxisRules([*rules, ("length", None)], conflicts="first")
    assert _spec(A, (8, 8, 8, 8), first) == P("X", None, "Y", None)
    with pytest.raises(jts.ShardingAnnotationError, match=r"'length'"):
        _spec(A, (8, 8, 8, 8), rules)
    strict = jts.AxisRules([*rules, ("length", None)])
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"dims 0 \(`batch`\) and 3 \(`features`\) both resolve to mesh axis 'X'",
    ):
        _spec(A, (8, 8, 8, 8), strict)


def test_fallback_lists_need_free_and_dividing_axes():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    A = Float[Array, "kv embed", jts.Logical]
    rules = {"kv": ["fsdp", "tensor"], "embed": "fsdp"}
    # kv = 2: 4 fsdp shards do not divide it; tensor does.
    assert _spec(A, (2, 8), rules, mesh) == P("tensor", "fsdp")
    # kv = 8: kv takes fsdp, and embed's only rule is taken.
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"dims 0 \(`kv`\) and 1 \(`embed`\) both resolve to mesh axis 'fsdp'",
    ):
        _spec(A, (8, 8), rules, mesh)
    # A list whose every candidate is refused: each one with its reason.
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"dim 1 \(`embed`\) fits none of the candidates of its axis rule "
        r"\('fsdp': 'fsdp' is taken by dim 0 \(`kv`\); 'tensor': its 2 shards do "
        r"not divide dim 1's size 3\)",
    ):
        _spec(A, (8, 3), {"kv": "fsdp", "embed": ["fsdp", "tensor"]}, mesh)
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"'fsdp': its 4 shards do not divide dim 0's size 1; 'tensor': its 2 "
        r"shards do not divide dim 0's size 1",
    ):
        _spec(A, (1, 8), rules, mesh)
    # By rank only (inside shard_map, an output): the first free candidate.
    assert _spec(A, 2, {"kv": ["fsdp", "tensor"], "embed": None}, mesh) == P(
        "fsdp", None
    )


def test_conflict_policies():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    A = Float[Array, "heads embed", jts.Logical]
    rules = {"heads": "fsdp", "embed": "fsdp"}
    with pytest.raises(jts.ShardingAnnotationError, match="both resolve"):
        _spec(A, (2, 8), rules, mesh)
    # "first" never looks at sizes: heads keeps fsdp even though 4 does not divide 2.
    assert _spec(A, (2, 8), jts.AxisRules(rules, conflicts="first"), mesh) == P(
        "fsdp", None
    )
    # "fallback": heads skips fsdp (does not divide), embed takes it.
    assert _spec(A, (2, 8), jts.AxisRules(rules, conflicts="fallback"), mesh) == P(
        None, "fsdp"
    )
    assert _spec(A, (8, 8), jts.AxisRules(rules, conflicts="fallback"), mesh) == P(
        "fsdp", None
    )


def test_mesh_axis_missing_in_a_candidate():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    A = Float[Array, "embed", jts.Logical]
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"the axis rule 'embed' -> \('fsdp', 'data'\) names mesh axis 'data', "
        r"but the mesh \('fsdp': 4, 'tensor': 2\) has no such axis",
    ):
        _spec(A, (8,), {"embed": [("fsdp", "data"), None]}, mesh)
    # Without a mesh nothing is checked against one.
    assert _spec(A, (8,), {"embed": "data"}) == P("data")


def test_unknown_names_all_listed():
    A = Float[Array, "batch seq embed", jts.Logical]
    with pytest.raises(
        jts.ShardingAnnotationError,
        match=r"no axis rule for logical names 'seq', 'embed' .* The rules in force: "
        r"\{'batch': 'data'\}\. .*\{'seq': None, 'embed': None\}",
    ):
        _spec(A, (8, 8, 8), {"batch": "data"})


# -- scoping -------------------------------------------------------------------


def test_scopes_nest_and_restore():
    assert jts.get_axis_rules() is None
    with jts.axis_rules({"a": "x"}) as outer:
        assert jts.get_axis_rules() == outer == jts.AxisRules({"a": "x"})
        with jts.axis_rules({"a": "y"}):
            assert jts.get_axis_rules() == jts.AxisRules({"a": "y"})
            with jts.axis_rules(None):
                assert jts.get_axis_rules() is None
        assert jts.get_axis_rules() == outer
    assert jts.get_axis_rules() is None


def test_process_default():
    setter = jts.set_axis_rules({"a": "x"})
    try:
        assert jts.get_axis_rules() == jts.AxisRules({"a": "x"})
        with jts.axis_rules({"a": "y"}):
            assert jts.get_axis_rules() == jts.AxisRules({"a": "y"})
        with jts.set_axis_rules({"a": "z"}, conflicts="first"):
            assert jts.get_axis_rules() == jts.AxisRules({"a": "z"}, conflicts="first")
        assert jts.get_axis_rules() == jts.AxisRules({"a": "x"})
        seen = []
        thread = threading.Thread(target=lambda: seen.append(jts.get_axis_rules()))
        thread.start()
        thread.join()
        assert seen == [jts.AxisRules({"a": "x"})]  # the default reaches all threads
    finally:
        with setter:
            pass
    assert jts.get_axis_rules() is None


def test_threads_do_not_see_each_others_scopes(mesh_2x2x2):
    A = Float[Array, "batch embed", jts.Logical]
    x = place(mesh_2x2x2, (8, 4), P("x"))
    barrier = threading.Barrier(2)
    results = {}

    def run(axis):
        with jts.axis_rules({"batch": axis, "embed": None}):
            barrier.wait()
            results[axis] = [isinstance(x, A) for _ in range(50)]

    threads = [threading.Thread(target=run, args=(a,)) for a in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"x": [True] * 50, "y": [False] * 50}


def test_async_tasks_have_their_own_rules():
    async def task(axis, gate):
        with jts.axis_rules({"batch": axis}):
            await gate.wait()
            return jts.get_axis_rules()

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(task(a, gate)) for a in ("x", "y")]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*tasks)

    got = asyncio.run(main())
    assert got == [jts.AxisRules({"batch": "x"}), jts.AxisRules({"batch": "y"})]
    # The tasks exited in another order than they entered: nothing is left over
    # in JAX's cache key, which follows the process default again.
    from jaxtyping_shard._rules.scope import _jax_key

    assert _jax_key.value is None
    with jts.set_axis_rules({"batch": "z"}):
        assert _jax_key.value == jts.AxisRules({"batch": "z"})


# -- one model, three tables, warm caches ----------------------------------------

Act = Float[Array, "batch embed", jts.Logical]
WIn = Float[Array, "embed mlp", jts.Logical]
WOut = Float[Array, "mlp embed", jts.Logical]

TABLES = {
    "fsdp": jts.AxisRules(
        {"batch": "fsdp", "embed": "fsdp", "mlp": None}, conflicts="first"
    ),
    "tp": jts.AxisRules({"batch": None, "embed": None, "mlp": "tensor"}),
    "fsdp+tp": jts.AxisRules(
        {"batch": "fsdp", "embed": "fsdp", "mlp": "tensor"}, conflicts="first"
    ),
}
# What each table means for (x, w_in, w_out), written out as mesh axes.
PLACEMENTS = {
    "fsdp": (P("fsdp", None), P("fsdp", None), P(None, "fsdp")),
    "tp": (P(None, None), P(None, "tensor"), P("tensor", None)),
    "fsdp+tp": (P("fsdp", None), P("fsdp", "tensor"), P("tensor", "fsdp")),
}


@jaxtyped(typechecker=beartype)
def step(x: Act, w_in: WIn, w_out: WOut) -> Act:
    return x + x


def _placed(mesh, name):
    spec_x, spec_in, spec_out = PLACEMENTS[name]
    return (
        place(mesh, (8, 8), spec_x),
        place(mesh, (8, 4), spec_in),
        place(mesh, (4, 8), spec_out),
    )


SEQUENCE = ["fsdp", "tp", "fsdp+tp", "fsdp", "tp"]


@pytest.mark.parametrize("wrapper", ["eager", "jax.jit", "jts.jit"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_tables_swapped_at_run_time(wrapper, kind):
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), kind)
    fn = {"eager": step, "jax.jit": jax.jit(step), "jts.jit": jts.jit(step)}[wrapper]
    placed = {name: _placed(mesh, name) for name in TABLES}
    for current in SEQUENCE:
        with jts.axis_rules(TABLES[current]):
            for other, args in placed.items():
                if PLACEMENTS[other] == PLACEMENTS[current]:
                    with no_transfers(), jts.sharding_errors():
                        assert fn(*args).shape == (8, 8)
                else:
                    with pytest.raises(CHECK_ERRORS), jts.sharding_errors():
                        fn(*args)


def test_warm_trace_cache_is_keyed_on_the_rules():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), "explicit")
    traces = []

    @jax.jit
    @jaxtyped(typechecker=beartype)
    def fn(x: Act, w_in: WIn, w_out: WOut) -> Act:
        traces.append(1)
        return x + x

    args = _placed(mesh, "fsdp")
    with jts.axis_rules(TABLES["fsdp"]):
        fn(*args)
        fn(*args)
    assert len(traces) == 1  # the cache works
    with jts.axis_rules(TABLES["fsdp+tp"]), pytest.raises(CHECK_ERRORS):
        fn(*args)  # traced again: the check ran under the new table
    with jts.axis_rules(jts.AxisRules(TABLES["fsdp"])):  # equal table: cache hit
        fn(*args)
    assert len(traces) == 1


def test_process_default_keys_the_trace_cache_too():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), "explicit")
    fn = jax.jit(step)
    args = _placed(mesh, "tp")
    with jts.set_axis_rules(TABLES["tp"]):
        assert fn(*args).shape == (8, 8)
        with jts.set_axis_rules(TABLES["fsdp"]), pytest.raises(CHECK_ERRORS):
            fn(*args)
        assert fn(*args).shape == (8, 8)
