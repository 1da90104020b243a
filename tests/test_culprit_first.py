"""The culprit first, on every path (issue 22, item 7).

- A function's logical annotations, return included, are resolved when it is
  entered (`jts.jaxtyped`, `jts.jit`'s boundary): a rules table that cannot
  resolve one is reported before the body runs, naming the parameter or return,
  the rule and the mesh, not after JAX's own error in the body.
- On Auto axes a value a sharding constraint made (plain
  `jax.lax.with_sharding_constraint`, `jax.device_put` in `jit`, `jts.reshard`) is
  decided at trace time, so it is named before the values XLA propagates its
  layout back to (the victims a compile-time report lists first).
- `check_tree(stacked=...)` reports a leaf whose rank cannot hold its layout as a
  mismatch among the others (warned in mode "warn"), not as an annotation error.
"""

import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._layout import resolve as _resolve
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import MESHES, place


L = jts.Logical
Rows = Float[Array, "batch embed", L]
Wide = Float[Array, "batch mlp", L]
GOOD = {"batch": "data", "embed": None, "mlp": "model"}
BAD = {  # what makes `Wide` unresolvable, whatever the array's shape
    "no rule": {"batch": "data", "embed": None},
    "missing axis": {**GOOD, "mlp": "nope"},
    "conflict": {**GOOD, "mlp": "data"},
}
RULE_NAMED = {
    "no rule": "'mlp'",
    "missing axis": "'mlp' -> 'nope'",
    "conflict": "'data'",
}


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


def _entered(checker: str, In, Out, ran: list):
    """`f(x: In) -> Out` under `jts.jaxtyped`, whose body fails in JAX."""

    def body(x):
        ran.append(True)
        return x @ jnp.ones((5, 6))  # JAX's own error: 4 != 5

    if checker == "beartype":

        @jts.jaxtyped(typechecker=beartype)
        def f(x: In) -> Out:
            return body(x)

    else:

        @jts.jaxtyped(typechecker=None)
        @typechecked
        def f(x: In) -> Out:
            return body(x)

    return f


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_the_return_annotation_is_resolved_on_entry(checker, mesh, bad, how):
    ran: list = []
    f = _entered(checker, Rows, Wide, ran)
    call = f if how == "eager" else jax.jit(f)
    x = place(mesh, (8, 4), P("data"))
    with jax.set_mesh(mesh), jts.axis_rules(GOOD):
        with pytest.raises(TypeError):  # the body runs: JAX's own error
            call(x)
    ran.clear()
    with jax.set_mesh(mesh), jts.axis_rules(BAD[bad]):  # warm caches, new rules
        with pytest.raises(jts.ShardingAnnotationError) as info:
            call(x)
    assert not ran
    text = str(info.value)
    assert text.startswith("the return annotation of `")
    assert RULE_NAMED[bad] in text and "mesh ('data': 4, 'model': 2" in text
    assert "before its body ran" in text
    with jax.set_mesh(mesh), jts.set_mode("off"), jts.axis_rules(BAD[bad]):
        with pytest.raises(TypeError):  # mode off: nothing resolved, the body runs
            call(x)


def test_a_parameter_annotation_is_named(mesh):
    ran: list = []
    f = _entered("beartype", Wide, Rows, ran)
    with jax.set_mesh(mesh), jts.axis_rules(BAD["no rule"]):
        with pytest.raises(jts.ShardingAnnotationError, match="parameter `x` of `"):
            f(place(mesh, (8, 6), P("data")))
    assert not ran


@jts.jaxtyped(typechecker=beartype)
def _forward(x: "Rows") -> "LaterWide":  # a name defined after the function
    _FORWARD_RAN.append(True)
    return x @ jnp.ones((5, 6))


LaterWide = Wide
_FORWARD_RAN: list = []


def test_hints_are_read_at_the_first_call(mesh):
    with jax.set_mesh(mesh), jts.axis_rules(BAD["no rule"]):
        with pytest.raises(jts.ShardingAnnotationError, match="return annotation"):
            _forward(place(mesh, (8, 4), P("data")))
    assert not _FORWARD_RAN


def test_the_jit_boundary_resolves_tree_hints_on_entry(mesh):
    # A return hint that is a tree (a dict of annotated leaves): `jts.jit`'s
    # boundary checks its leaves after the body; their annotations resolve first.
    ran: list = []

    @jts.jit
    def step(x: Float[Array, "batch embed", L]) -> dict[str, Wide]:
        ran.append(True)
        return {"h": x @ jnp.ones((5, 6))}

    x = place(mesh, (8, 4), P("data"))
    with jax.set_mesh(mesh), jts.axis_rules(BAD["missing axis"]):
        with pytest.raises(jts.ShardingAnnotationError) as info:
            step(x)
    assert not ran
    assert str(info.value).startswith("the return annotation of `")
    assert "'mlp' -> 'nope'" in str(info.value)


def test_a_fallback_the_shape_resolves_is_not_refused_on_entry(mesh):
    # By rank, `batch` would take `data` (its first candidate) and leave `mlp`
    # none; with the shape (6 rows do not divide by 4) it takes `model`, and `mlp`
    # takes `data`. Only errors no shape can change are raised on entry.
    table = jts.axis_rules(
        {"batch": ["data", "model"], "embed": None, "mlp": "data"}, conflicts="error"
    )

    @jts.jaxtyped(typechecker=beartype)
    def f(x: Rows) -> Wide:
        return x @ jnp.ones((4, 8))

    x = place(mesh, (6, 4), P("model"))
    with jax.set_mesh(mesh), table:
        jts.set_mode("warn")  # the layout XLA picks is not the point here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jts.ShardingWarning)
            assert f(x).shape == (6, 8)


def test_differential_entry_against_resolution_with_the_shape():
    # Random tables and annotations: an error on entry (by rank) is one the
    # array's shape gives too (no false alarm), and every error the shape gives
    # that no shape could change is given on entry.
    rng = random.Random(0)
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    names = ["a", "b", "c"]
    choices = ["data", "model", ("data", "model"), None, "nope", ["data", None]]
    choices.append(["model", "data"])
    for _ in range(300):
        table = {n: rng.choice(choices) for n in names if rng.random() < 0.9}
        if rng.random() < 0.3:  # Flax Linen's pairs, in order of priority
            table = [(n, a) for n, a in table.items() if not isinstance(a, list)]
        conflicts = rng.choice(["error", "first", "fallback"])
        try:
            with jts.axis_rules(table, conflicts=conflicts) as rules:
                pass
        except jts.ShardingAnnotationError:
            continue  # a table refused when set
        dims = [rng.choice(names) for _ in range(rng.randint(1, 3))]
        sizes = " ".join(f"d{i}" for i in range(len(dims)))
        layout = Float[Array, sizes, L(*dims)]._jts
        shape = tuple(rng.choice([4, 6, 8]) for _ in dims)
        on_entry = _raises(_resolve.check_resolvable, layout, mesh, rules, "h")
        with_shape = _raises(_resolve.resolve, layout, shape, mesh, rules, "h")
        if on_entry:
            assert with_shape, (table, conflicts, dims, shape)
        # One candidate each: the shape cannot matter.
        shape_free = all(len(rules.candidates(n) or ()) <= 1 for n in dims)
        if with_shape and shape_free:
            assert on_entry, (table, conflicts, dims, shape)


def _raises(call, *args) -> bool:
    try:
        call(*args)
    except jts.ShardingAnnotationError:
        return True
    return False


# -- a value a sharding constraint made: decided at trace time (Auto axes) -----

SPECS = [P("data"), P("model"), P(None, "data"), P(), P(("data", "model"))]


def _producer(how: str, spec: P, mesh):
    if how == "with_sharding_constraint":
        return lambda v: jax.lax.with_sharding_constraint(v, spec)
    # Inside `jit` on Auto axes `device_put` sets no layout (it lowers to nothing):
    # its value is left to XLA, and checked when XLA has chosen.
    return lambda v: jax.device_put(v, NamedSharding(mesh, spec))


@pytest.mark.parametrize("how", ["with_sharding_constraint", "device_put"])
def test_differential_verdicts_against_xla(mesh_auto, how):
    # Random (producer spec, annotation) pairs: the verdict is XLA's own (the
    # layout of the compiled program's output), at trace time for a constraint's
    # value (nothing compiled), at compile time otherwise.
    rng = np.random.default_rng(1)
    x = place(mesh_auto, (8, 4), P())
    seen = set()
    for n in range(8):
        given, wanted = (SPECS[i] for i in rng.integers(len(SPECS), size=2))
        wanted = {0: given, 1: P()}.get(n, wanted)  # a pass on each path
        produce = _producer(how, given, mesh_auto)
        annotation = Float[Array, "b e", wanted]

        def f(v, produce=produce, annotation=annotation):
            y = produce(jnp.sin(v))
            assert isinstance(y, annotation)
            return y

        with jax.set_mesh(mesh_auto):
            laid_out = jax.jit(produce).lower(x).compile().output_shardings
            xla = NamedSharding(mesh_auto, wanted).is_equivalent_to(laid_out, 2)
            seen.add(xla)
            if xla or how == "device_put":
                jax.jit(f).trace(x)
            else:
                with pytest.raises(AssertionError):  # at trace time: nothing compiled
                    jax.jit(f).trace(x)
            if xla:
                jax.jit(f)(x)
            else:
                with pytest.raises((AssertionError, jts.ShardingTypeCheckError)):
                    jax.jit(f)(x)
    assert seen == {True, False}


def _victims_and_culprit(mesh):
    """`up` returns a value that `step` then constrains wrongly: XLA lays `up`'s
    result out as constrained too (backwards), so at compile time the victim (the
    return value of `up`) comes first in trace order; the culprit is `y` of
    `down`, which is the constraint's own value."""
    Row = Float[Array, "b e", P("data")]

    @jts.jaxtyped(typechecker=beartype)
    def up(x: Row) -> Row:
        return x * 2

    @jts.jaxtyped(typechecker=beartype)
    def down(y: Row) -> Row:
        return y + 1

    def step(x):
        return down(jax.lax.with_sharding_constraint(up(x), P("model")))

    return step


@pytest.mark.parametrize("under", ["jit", "grad"])
def test_the_constrained_value_is_named_first(mesh_auto, under):
    step = _victims_and_culprit(mesh_auto)
    run = jax.jit(step if under == "jit" else jax.grad(lambda v: step(v).sum()))
    x = place(mesh_auto, (8, 4), P("data"))
    with jax.set_mesh(mesh_auto):
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            run(x)
        assert str(info.value).startswith("argument `y` of `")
        assert "by a sharding constraint" in str(info.value)
        jts.set_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.jit(lambda v: step(v) * 1)(x)  # a new trace: warns, then compiles
    found = [str(w.message) for w in caught if w.category is jts.ShardingWarning]
    assert found and found[0].startswith("argument `y` of `"), found


def test_constraints_that_leave_the_layout_open_wait_for_xla(mesh_auto):
    # An unconstrained dim, or a value under `vmap`: XLA decides, at compile time.
    Row = Float[Array, "b e", P("model")]
    x = place(mesh_auto, (8, 4), P("data"))

    def open_dim(v):
        y = jax.lax.with_sharding_constraint(v, P("data", P.UNCONSTRAINED))
        assert isinstance(y, Row)
        return y

    def batched(v):
        def one(row):
            r = jax.lax.with_sharding_constraint(row, P())
            assert isinstance(r, Float[Array, "e", P("model")])
            return r

        return jax.vmap(one)(v)

    with jax.set_mesh(mesh_auto):
        for f in (open_dim, batched):
            jax.jit(f).trace(x)  # nothing decided at trace time
            with pytest.raises(jts.ShardingTypeCheckError, match="XLA sharded it"):
                jax.jit(f)(x)


# -- check_tree(stacked=...): a leaf of the wrong rank among the others --------

W = Float[Array, "e m", P("data", "model")]
LEAVES = {  # kind: (shape, placement); the stack is declared one dim deep
    "ok": ((2, 8, 4), P(None, "data", "model")),
    "wrong layout": ((2, 8, 4), P(None, "model", "data")),
    "not stacked": ((8, 4), P("data", "model")),
    "stacked twice": ((2, 2, 8, 4), P(None, None, "data", "model")),
}


@pytest.mark.parametrize("mode", ["check", "warn", "off"])
def test_differential_stacked_rank_is_one_mismatch_among_the_others(mesh, mode):
    rng = random.Random(2)
    for _ in range(4):
        kinds = [rng.choice(list(LEAVES)) for _ in range(5)] + ["not stacked"]
        rng.shuffle(kinds)
        tree = {
            "blocks": {f"w{i}": place(mesh, *LEAVES[k]) for i, k in enumerate(kinds)}
        }
        annotations = {"blocks": {f"w{i}": W for i in range(len(kinds))}}
        bad = [f"w{i}" for i, k in enumerate(kinds) if k != "ok"]
        ranks = [
            f"w{i}" for i, k in enumerate(kinds) if k.startswith(("not", "stacked"))
        ]
        with jts.set_mode(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "check":
                with pytest.raises(jts.ShardingTypeCheckError) as info:
                    jts.check_tree(tree, annotations, stacked={"blocks/*": 1})
            else:
                jts.check_tree(tree, annotations, stacked={"blocks/*": 1})
        warned = [str(w.message) for w in caught if w.category is jts.ShardingWarning]
        if mode == "check":
            text = str(info.value)
            assert f"{len(bad)} of {len(kinds)} checked leaves" in text
            listed = [line for line in text.splitlines() if line.startswith("  ")]
            assert sorted(line.split("'")[3] for line in listed) == sorted(bad)
            for name in ranks:
                assert f"tree['blocks']['{name}']: rank " in text
            assert not warned
        elif mode == "warn":
            assert len(warned) == len(bad)
            for name in ranks:
                assert any(f"tree['blocks']['{name}']: rank " in w for w in warned)
        else:
            assert not warned


def test_stacked_rank_inside_jit_is_found_at_trace_time(mesh_explicit):
    tree = {"blocks": {"w": place(mesh_explicit, *LEAVES["not stacked"])}}
    tree["blocks"]["v"] = place(mesh_explicit, *LEAVES["wrong layout"])
    annotations = {"blocks": {"w": W, "v": W}}
    check = jax.jit(lambda t: jts.check_tree(t, annotations, stacked={"blocks/*": 1}))
    with pytest.raises(jts.ShardingTypeCheckError, match="2 of 2 checked leaves"):
        check.trace(tree)
