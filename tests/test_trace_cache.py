"""The passes kept at trace time (issue 38, item 3) never stand in for a check
whose verdict differs.

On an Explicit mesh a tracer's verdict is a function of its type (shape, dtype,
sharding, mesh) and, for a logical annotation, of the rules table; each
annotation keeps the types it passed (`_annotation.hot_path.keep_traced`).
Each test warms that cache (and JAX's), changes one thing (the mesh, the rules,
the mode) and checks again: the verdict follows the change, eagerly, at trace
time in one trace, and through `jax.jit` and `jts.jit`. Auto meshes (the
verdict is XLA's) and `shard_map` bodies keep nothing.
"""

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, Int
from jaxtyping_shard._annotation import dtypes as _dtypes, hot_path as _hot_path
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS, make_identity, place


A = Float[Array, "b e", P("data", None)]
INLINE = Float[Array, "b@data e"]
LOGICAL = Float[Array, "batch embed", jts.Logical]
RULES = {"batch": "data", "embed": None}
OTHER_RULES = {"batch": "model", "embed": None}
# Ways to set the context mesh: `jax.sharding.use_mesh` too where this JAX has it.
SETTERS = [jax.set_mesh] + [
    s for s in [getattr(jax.sharding, "use_mesh", None)] if s is not None
]


@pytest.fixture
def counted(monkeypatch):
    """The annotations the verdict itself (`_verdict.check.check`) ran for."""
    calls = []
    real = _dtypes.check

    def counting(cls, obj):
        calls.append(cls)
        return real(cls, obj)

    monkeypatch.setattr(_dtypes, "check", counting)
    monkeypatch.setattr(_hot_path, "_SHARED", {})  # no pass kept by other tests
    # Nor by any annotation's own cache: jaxtyping caches `Float[...]`, so a test
    # that ran earlier (in any file, in any order) warmed the same classes.
    for ann in _live_annotations():
        ann._jts_traced.clear()  # a cache of passes only: emptying it is safe
    return calls


def _live_annotations():
    """Every sharded annotation class alive in this process: the subclasses of
    jaxtyping's `AbstractArray` that this package made."""
    seen, todo = set(), [jaxtyping.AbstractArray]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return [c for c in seen if isinstance(c, _dtypes._MetaShardedArray)]


@pytest.fixture(params=["explicit", "auto"])
def kind_mesh(request):
    return request.param, make_mesh((4, 2), ("data", "model"), request.param)


def _trace(fn, *args):
    """`fn`'s body run once at trace time, on tracers of `args`."""
    jax.jit(fn).trace(*args)


def _refusing(ann, reshard_to=None):
    """A jitted function that raises at trace time unless its value is `ann`."""

    def f(x):
        y = x if reshard_to is None else jax.sharding.reshard(x * 2, reshard_to)
        if not isinstance(y, ann):
            raise TypeError("refused at trace time")
        return y

    return jax.jit(f)


def _calls(f, x, verdict):
    if verdict:
        assert f(x).shape == x.shape
    else:
        with pytest.raises(TypeError, match="refused"):
            f(x)


@pytest.mark.parametrize("ann", [A, INLINE], ids=["spec", "inline"])
def test_a_pass_is_kept_per_type_and_only_a_pass(counted, ann):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    good, bad = place(mesh, (8, 4), P("data")), place(mesh, (8, 4), P("model"))
    tall = place(mesh, (16, 4), P("data"))
    seen = []

    def f(x, y, z):
        for _ in range(50):
            seen.append((isinstance(x, ann), ann.__instancecheck_str__(x)))
        seen.append((isinstance(y, ann), ann.__instancecheck_str__(y)))
        seen.append((isinstance(z, ann), ann.__instancecheck_str__(z)))  # new shape
        return x

    _trace(f, good, bad, tall)
    assert seen[:50] == [(True, "")] * 50
    assert seen[50][0] is False and "8@model" in seen[50][1]
    assert seen[51] == (True, "")
    # One verdict for the 100 checks of `x`; the failure twice (never kept);
    # one for the new shape.
    assert len(counted) == 4


def test_a_pass_is_shared_by_the_annotations_of_one_layout(counted):
    # A model's fields are as many annotations: the verdict is the layout's,
    # jaxtyping's dtype and dims check each annotation's own.
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    first = Float[Array, "b e", P("data", None)]
    same = [Float[Array, "rows cols", P("data")], Float[Array, "b@data e"]]
    wrong = [Float[Array, "4 4", P("data", None)], Int[Array, "b e", P("data", None)]]
    other = Float[Array, "b e", P("model", None)]
    seen = []

    def f(x):
        seen.extend(isinstance(x, a) for a in [first, *same, *wrong, other])
        seen.extend(isinstance(x, a) for a in [first, *same, *wrong, other])
        return x

    _trace(f, place(mesh, (8, 4), P("data")))
    assert seen == [True, True, True, False, False, False] * 2
    assert counted == [first, other, other]  # shape and dtype fail first


@pytest.mark.parametrize("setter", SETTERS, ids=lambda s: s.__name__)
def test_a_new_context_mesh_changes_the_verdict(setter):
    # `model` of size 1 replicates: P("data", "model") is P("data", None) there,
    # and not on the 4x2 mesh. The same jitted function, warmed on one mesh.
    f = _refusing(A, P("data", "model"))
    x = jnp.ones((8, 4))
    narrow = make_mesh((8, 1), ("data", "model"), "explicit")
    wide = make_mesh((4, 2), ("data", "model"), "explicit")
    for mesh, verdict in [(narrow, True), (wide, False)] * 2:
        with setter(mesh):
            _calls(f, x, verdict)
    # Eagerly and through beartype, on the arrays placed on each mesh.
    on_narrow = place(narrow, (8, 4), P("data", "model"))
    on_wide = place(wide, (8, 4), P("data", "model"))
    assert isinstance(on_narrow, A) and not isinstance(on_wide, A)
    g = jax.jit(make_identity("beartype", A, A))
    assert g(on_narrow).shape == (8, 4)
    with pytest.raises(CHECK_ERRORS):
        g(on_wide)
    assert g(on_narrow).shape == (8, 4)


def test_a_new_rules_table_changes_the_verdict(counted):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    x = place(mesh, (8, 4), P("data"))
    seen = []

    def f(x):
        for rules in [RULES, OTHER_RULES] * 2:
            with jts.axis_rules(rules):
                seen.append(isinstance(x, LOGICAL))
        return x

    _trace(f, x)
    assert seen == [True, False, True, False]
    assert len(counted) == 3  # the pass kept; each failure decided afresh
    # Through jax.jit's caches (the rules are in their key), and eagerly.
    g = _refusing(LOGICAL)
    for rules, verdict in [(RULES, True), (OTHER_RULES, False)] * 2:
        with jts.axis_rules(rules):
            assert isinstance(x, LOGICAL) is verdict
            _calls(g, x, verdict)


def test_a_new_rules_table_through_jts_jit(kind_mesh):
    _, mesh = kind_mesh
    good = place(mesh, (8, 4), P("data"))

    def f(x: list[LOGICAL]) -> list[LOGICAL]:
        return x

    g = jts.jit(f)
    for _ in range(2):
        with jts.axis_rules(RULES):
            assert g([good])[0].shape == (8, 4)
        with jts.axis_rules(OTHER_RULES), pytest.raises(CHECK_ERRORS):
            g([good])


def test_warn_mode_keeps_no_failure(counted):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    bad = place(mesh, (8, 4), P("model"))
    seen = []

    def f(x):
        with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning):
            seen.append(isinstance(x, A))  # warned: it reads as a pass
        seen.append(isinstance(x, A))
        with jts.set_mode("off"):
            seen.append(isinstance(x, A))
        seen.append(isinstance(x, A))
        return x

    _trace(f, bad)
    assert seen == [True, False, True, False]
    assert len(counted) == 3  # mode "off" decides nothing


def test_a_pass_kept_in_one_mode_holds_in_every_mode(kind_mesh):
    _, mesh = kind_mesh
    good, bad = place(mesh, (8, 4), P("data")), place(mesh, (8, 4), P("model"))
    f = jax.jit(make_identity("beartype", A, A))
    for mode in ["check", "warn", "off"]:
        with jts.set_mode(mode):
            assert f(good).shape == (8, 4)
    with pytest.raises(CHECK_ERRORS), jts.sharding_errors():
        f(bad)
    jts.set_mode("off")
    assert f(bad).shape == (8, 4)
    jts.set_mode("check")
    with pytest.raises(CHECK_ERRORS), jts.sharding_errors():
        f(bad)


def test_auto_axes_keep_nothing(counted):
    # On Auto axes the type says nothing of the layout: two values of one type,
    # one laid out as declared and one not, are each left to XLA.
    mesh = make_mesh((4, 2), ("data", "model"), "auto")
    good, bad = place(mesh, (8, 4), P("data")), place(mesh, (8, 4), P("model"))
    ann = Float[Array, "b e", P("data", None)]

    def f(x, y):
        a, b = x * 2, y * 2
        assert jax.typeof(a) == jax.typeof(b)
        assert isinstance(a, ann) and isinstance(b, ann)  # left to XLA
        return a, b

    with jts.sharding_errors():
        assert jax.jit(f)(good, good)[0].shape == (8, 4)
        with pytest.raises(CHECK_ERRORS):
            jax.jit(f)(good, bad)
    # One trace (Auto types carry no layout, so JAX reuses it for the second
    # call): both checks of one type ran, and each was left to XLA.
    assert len(counted) == 2
    assert not ann._jts_traced


def test_shard_map_bodies_keep_nothing(counted):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    x = place(mesh, (8, 4), P("data"))
    seen = []

    def body(local):
        seen.append(isinstance(local, A))
        seen.append(isinstance(local, A))
        return local

    g = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    jax.jit(g)(x)
    assert seen == [True, True]
    assert len(counted) == 2  # Manual axes: decided each time


def test_the_kept_types_are_bounded(monkeypatch):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    ann = Float[Array, "b e", P("data", None)]
    seen = []

    def f(x):
        for n in range(1, 21):
            y = jax.sharding.reshard(jnp.ones((8, n)), NamedSharding(mesh, P("data")))
            seen.append(isinstance(y, ann))
        return x

    monkeypatch.setattr("jaxtyping_shard._annotation.hot_path._TRACED_LIMIT", 8)
    _trace(f, place(mesh, (8, 4), P("data")))
    assert seen == [True] * 20
    assert 0 < len(ann._jts_traced) <= 8


def test_jts_jit_names_the_leaf_after_a_kept_pass(kind_mesh):
    _, mesh = kind_mesh
    good, bad = place(mesh, (8, 4), P("data")), place(mesh, (8, 4), P("model"))

    def f(x: list[A]) -> list[A]:
        return x

    g = jts.jit(f)
    assert len(g([good, good, good])) == 3
    with pytest.raises(CHECK_ERRORS) as caught:
        g([good, bad, good])
    assert "x[1]" in str(caught.value) and "x[0]" not in str(caught.value)
    assert len(g([good, good, good])) == 3
