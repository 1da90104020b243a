"""`Logical` annotations: dims named logically, resolved by the rules in force."""

import pickle

import jax
import jaxtyping
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import CHECK_ERRORS, make_identity, no_transfers, place


FSDP = {"embed": "fsdp", "mlp": "tensor"}
Square = Float[Array, "embed embed", jts.Logical]
SquareOut = Float[Array, "embed embed", jts.Logical("embed", "embed_out")]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return make_mesh((4, 2), ("fsdp", "tensor"), request.param)


@pytest.fixture
def mesh_explicit_ft():
    return make_mesh((4, 2), ("fsdp", "tensor"), "explicit")


def _fails(A, x):
    return A.__instancecheck_str__(x) != ""


# -- the annotation ------------------------------------------------------------


def test_names_and_pickle():
    assert Square.__name__.endswith("'embed embed', Logical]")
    assert SquareOut.__name__.endswith("Logical('embed', 'embed_out')]")
    # jax.Array cannot be pickled by reference; np.ndarray can (see test_annotation).
    for marker in (jts.Logical, jts.Logical("embed", "embed_out")):
        A = Float[np.ndarray, "embed embed", marker]
        B = pickle.loads(pickle.dumps(A))
        assert B.__name__ == A.__name__ and B._jts == A._jts
    assert issubclass(Square, jaxtyping.AbstractArray)
    assert Square.dtypes == jaxtyping.Float.dtypes


def test_no_rules_needed_to_write_it():
    # Written at import time, with no rules anywhere: nothing is resolved yet.
    with jts.axis_rules(None):
        A = Float[Array, "batch seq embed", jts.Logical]
    assert A._jts.names(3) == ("batch", "seq", "embed")


@pytest.mark.parametrize(
    "dims, names",
    [
        ("batch 3 embed", ("batch", None, "embed")),
        ("_ #embed _mlp", (None, "embed", "mlp")),
        ("batch n+1", ("batch", None)),
    ],
)
def test_bare_logical_names_from_dims(dims, names):
    assert Float[Array, dims, jts.Logical]._jts.names(len(names)) == names


@pytest.mark.parametrize(
    "dims, marker, match",
    [
        ("embed embed", jts.Logical("embed"), r"gives 1 logical names for the 2 dims"),
        ("*b embed", jts.Logical("b", "embed"), r"names the variadic dim '\*b'"),
        ("embed@fsdp mlp", jts.Logical, r"gives the sharding twice"),
    ],
)
def test_malformed_at_subscription(dims, marker, match):
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        Float[Array, dims, marker]


@pytest.mark.parametrize(
    "args, match",
    [((), r"needs one logical name per dim"), (("em bed",), r"is not a logical name")],
)
def test_malformed_logical(args, match):
    with pytest.raises(jts.ShardingAnnotationError, match=match):
        jts.Logical(*args)


# -- Haliax #53: the square weight ------------------------------------------------


def test_square_weight_strict_is_an_error(mesh_explicit_ft):
    w = place(mesh_explicit_ft, (8, 8), P("fsdp", None))
    with jts.axis_rules(FSDP), pytest.raises(jts.ShardingAnnotationError) as info:
        isinstance(w, Square)
    message = str(info.value)
    assert (
        "dims 0 (`embed`) and 1 (`embed`) both resolve to mesh axis 'fsdp'" in message
    )
    assert "{'embed': 'fsdp', 'mlp': 'tensor'}" in message
    assert "conflicts='first'" in message
    assert "Logical('embed', 'embed_out')" in message
    assert "fallback list" in message


def test_square_weight_first_shards_exactly_one_dim(checker, mesh):
    f = jts.jit(make_identity(checker, Square, Square))
    w = place(mesh, (8, 8), P("fsdp", None))
    with jts.axis_rules(FSDP, conflicts="first"):
        with no_transfers():
            assert f(w).shape == (8, 8)
        for spec in (P(None, "fsdp"), P(None, None), P("fsdp", "tensor")):
            with pytest.raises(CHECK_ERRORS):
                f(place(mesh, (8, 8), spec))


def test_square_weight_keeps_its_size_binding(mesh_explicit_ft):
    # "embed embed" still means: both dims have the same size.
    with jts.axis_rules(FSDP, conflicts="first"):
        assert not _fails(Square, place(mesh_explicit_ft, (8, 8), P("fsdp")))
        assert _fails(Square, place(mesh_explicit_ft, (8, 4), P("fsdp")))
        assert _fails(SquareOut, place(mesh_explicit_ft, (8, 4), P("fsdp", "tensor")))


def test_square_weight_named_apart(checker, mesh):
    f = jts.jit(make_identity(checker, SquareOut, SquareOut))
    with jts.axis_rules({"embed": "fsdp", "embed_out": "tensor"}):
        assert f(place(mesh, (8, 8), P("fsdp", "tensor"))).shape == (8, 8)
        with pytest.raises(CHECK_ERRORS):
            f(place(mesh, (8, 8), P("fsdp", None)))
    # The same annotation under FSDP only: embed_out replicated on purpose.
    with jts.axis_rules({"embed": "fsdp", "embed_out": None}):
        assert f(place(mesh, (8, 8), P("fsdp", None))).shape == (8, 8)


def test_square_weight_fallback_list(mesh_explicit_ft):
    w = place(mesh_explicit_ft, (8, 8), P("fsdp", "tensor"))
    with jts.axis_rules({"embed": ["fsdp", "tensor"]}):
        assert isinstance(w, Square)
    with jts.axis_rules({"embed": ["fsdp", None]}):
        assert not isinstance(w, Square)
        assert isinstance(place(mesh_explicit_ft, (8, 8), P("fsdp")), Square)


# -- every check path -----------------------------------------------------------


def test_eager_match_and_mismatch_message(checker, mesh_explicit_ft):
    A = Float[Array, "batch embed", jts.Logical]
    f = make_identity(checker, A, A)
    good = place(mesh_explicit_ft, (8, 4), P("fsdp"))
    x = place(mesh_explicit_ft, (8, 4), P("tensor"))
    with jts.axis_rules({"batch": "fsdp", "embed": None}):
        with no_transfers():
            assert f(good).shape == (8, 4)
            message = A.__instancecheck_str__(x)
            with pytest.raises(CHECK_ERRORS):
                f(x)
    assert "sharded as `float32[8@tensor,4]`, not P('fsdp', None)" in message
    assert "from logical `batch embed` by the axis rules" in message
    assert "{'batch': 'fsdp', 'embed': None}" in message


def test_jit_auto_mismatch_names_the_rules():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"), "auto")
    A = Float[Array, "batch embed", jts.Logical]
    f = jts.jit(make_identity("beartype", A, A))
    x = place(mesh, (8, 4), P("tensor"))
    with jts.axis_rules({"batch": "fsdp", "embed": None}):
        with pytest.raises(CHECK_ERRORS, match=r"not P\('fsdp', None\) \(from logical"):
            f(x)


def test_numpy_and_single_device(mesh_explicit_ft):
    A = Float[np.ndarray, "batch embed", jts.Logical]
    B = Float[Array, "batch embed", jts.Logical]
    x = np.ones((8, 4), np.float32)
    one_device = jax.device_put(x)
    with jts.axis_rules({"batch": None, "embed": None}):
        assert isinstance(x, A) and isinstance(one_device, B)
    with jts.axis_rules({"batch": "fsdp", "embed": None}):
        assert not isinstance(x, A) and not isinstance(one_device, B)
        with jax.set_mesh(mesh_explicit_ft):
            assert not isinstance(x, A) and not isinstance(one_device, B)
    with jts.axis_rules({"batch": "data", "embed": None}):
        with jax.set_mesh(mesh_explicit_ft):
            with pytest.raises(jts.ShardingAnnotationError, match="no such axis"):
                isinstance(x, A)


def test_variadic(mesh_explicit_ft):
    A = Float[Array, "*batch embed", jts.Logical]
    with jts.axis_rules({"embed": "tensor"}):
        assert isinstance(place(mesh_explicit_ft, (4, 8), P(None, "tensor")), A)
        assert isinstance(
            place(mesh_explicit_ft, (2, 4, 8), P(None, None, "tensor")), A
        )
        assert not isinstance(place(mesh_explicit_ft, (2, 4, 8), P(None, "tensor")), A)


def test_inside_shard_map(checker, mesh):
    A = Float[Array, "batch embed", jts.Logical]
    inner = make_identity(checker, A, A)
    x = place(mesh, (8, 4), P("fsdp"))
    run = jax.jit(
        jax.shard_map(inner, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    )
    with jts.axis_rules({"batch": "fsdp", "embed": None}):
        assert run(x).shape == (8, 4)
    with jts.axis_rules({"batch": "tensor", "embed": None}):
        with pytest.raises(CHECK_ERRORS):
            run(x)

    reasons = []

    def body(v):
        reasons.append(A.__instancecheck_str__(v))
        return v

    with jts.axis_rules({"batch": "tensor", "embed": None}):
        jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))(x)
    assert "does not vary over 'tensor'" in reasons[0]
    assert "varies over 'fsdp'" in reasons[0]


def test_typed_shard_map_reads_the_rules(mesh):
    @jts.typed_shard_map(mesh=mesh)
    def col(
        x: Float[Array, "batch embed", jts.Logical],
        w: Float[Array, "embed mlp", jts.Logical],
    ) -> Float[Array, "batch mlp", jts.Logical]:
        return x @ w

    x = place(mesh, (8, 4), P("fsdp"))
    w = place(mesh, (4, 2), P(None, "tensor"))
    with jts.axis_rules({"batch": "fsdp", "embed": None, "mlp": "tensor"}):
        out = jax.jit(col)(x, w)
        assert out.sharding.spec == P("fsdp", "tensor")
    # Another table, the same function: different in_specs / out_specs.
    with jts.axis_rules({"batch": None, "embed": None, "mlp": "tensor"}):
        out = jax.jit(col)(place(mesh, (8, 4), P()), w)
        assert out.sharding.spec == P(None, "tensor")
    with jts.axis_rules({"batch": "fsdp"}):
        with pytest.raises(
            jts.ShardingAnnotationError, match=r"no axis rule for logical name 'embed'"
        ):
            col(x, w)


def test_mode_warn_and_off(mesh_explicit_ft):
    A = Float[Array, "batch embed", jts.Logical]
    x = place(mesh_explicit_ft, (8, 4), P("tensor"))
    with jts.axis_rules({"batch": "fsdp", "embed": None}):
        with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning, match="logical"):
            assert isinstance(x, A)
        with jts.set_mode("off"):
            assert isinstance(x, A)
    # Mode off: not even resolved (no rules in force here).
    with jts.set_mode("off"):
        assert isinstance(x, A)


# -- the bridge: spec_of, sharding_of, shardings ----------------------------------


def test_spec_of_and_sharding_of_resolve_with_the_rules(mesh_explicit_ft):
    W = Float[Array, "embed mlp", jts.Logical]
    with jts.axis_rules({"embed": "fsdp", "mlp": "tensor"}):
        assert jts.spec_of(W) == P("fsdp", "tensor")
        sharding = jts.sharding_of(W, mesh_explicit_ft)
        assert sharding.spec == P("fsdp", "tensor")
        assert sharding.mesh is mesh_explicit_ft
    with jts.axis_rules({"embed": None, "mlp": "tensor"}):
        assert jts.spec_of(W) == P(None, "tensor")
        with jax.set_mesh(mesh_explicit_ft):
            assert jts.sharding_of(W).spec == P(None, "tensor")
    with jts.axis_rules({"embed": "data", "mlp": None}):
        assert jts.spec_of(W) == P("data", None)  # no mesh: nothing to check against
        with pytest.raises(jts.ShardingAnnotationError, match=r"'embed' -> 'data'"):
            jts.sharding_of(W, mesh_explicit_ft)
    with pytest.raises(
        jts.ShardingAnnotationError, match=r"no axis rules are in force"
    ):
        jts.spec_of(W)
    with jts.axis_rules({"embed": "fsdp"}, conflicts="first"):
        assert jts.spec_of(Square) == P("fsdp", None)
        assert jts.spec_of(Float[Array, "*b embed", jts.Logical], ndim=3) == P(
            None, None, "fsdp"
        )


def test_shardings_of_a_tree_follow_the_table(mesh_explicit_ft):
    params = {
        "w_in": jax.ShapeDtypeStruct((8, 2), jax.numpy.float32),
        "w_sq": jax.ShapeDtypeStruct((8, 8), jax.numpy.float32),
    }
    annotations = {
        "w_in": Float[Array, "embed mlp", jts.Logical],
        "w_sq": Square,
    }
    fsdp = jts.AxisRules({"embed": "fsdp", "mlp": None}, conflicts="first")
    tp = jts.AxisRules({"embed": None, "mlp": "tensor"})
    # `mlp` = 2: fsdp (4) does not divide it, tensor (2) does: the leaf's shape
    # picks the candidate.
    lists = jts.AxisRules({"embed": ["fsdp", None], "mlp": ["fsdp", "tensor"]})
    expected = {
        fsdp: {"w_in": P("fsdp", None), "w_sq": P("fsdp", None)},
        tp: {"w_in": P(None, "tensor"), "w_sq": P(None, None)},
        lists: {"w_in": P("fsdp", "tensor"), "w_sq": P("fsdp", None)},
    }
    for rules, specs in [*expected.items(), *expected.items()]:
        with jts.axis_rules(rules):
            out = jts.shardings(params, mesh_explicit_ft, annotations=annotations)
        assert {k: v.spec for k, v in out.items()} == specs


# -- through the checkers ----------------------------------------------------------


@pytest.mark.parametrize("wrap", ["eager", "jax.jit"])
def test_resolution_errors_reach_the_caller_unwrapped(checker, wrap, mesh):
    # Not a value that fails its type: a table that cannot mean anything. Every
    # checker lets the ShardingAnnotationError through as it is.
    f = make_identity(checker, Square, Square)
    f = jax.jit(f) if wrap == "jax.jit" else f
    w = place(mesh, (8, 8), P("fsdp"))
    with (
        jts.axis_rules(FSDP),
        pytest.raises(
            jts.ShardingAnnotationError, match=r"dims 0 \(`embed`\) and 1 \(`embed`\)"
        ),
    ):
        f(w)


def test_jts_jaxtyped_message_names_the_rules(mesh_explicit_ft):
    from beartype import beartype

    @jts.jaxtyped(typechecker=beartype)
    def f(x: Square) -> Square:
        return x

    w = place(mesh_explicit_ft, (8, 8), P("fsdp"))
    with jts.axis_rules({"embed": "tensor"}, conflicts="first"):
        with pytest.raises(CHECK_ERRORS) as info:
            f(w)
    message = str(info.value)
    assert "argument `x` of `" in message
    assert (
        "this array is sharded as `float32[8@fsdp,8]`, not P('tensor', None) (from "
        "logical `embed embed` by the axis rules {'embed': 'tensor'} "
        "(conflicts='first')) as expected by the type hint (mesh ('fsdp': 4, "
        "'tensor': 2))"
    ) in message


def test_cached_resolution_sees_the_shape(mesh_explicit_ft):
    # One sharding object for two shapes: `a` = 2 is not divided by fsdp's 4, so
    # the fallback list replicates it; `a` = 8 is, so it must be sharded.
    A = Float[Array, "a b", jts.Logical]
    replicated = jax.sharding.NamedSharding(mesh_explicit_ft, P())
    small = jax.device_put(jax.numpy.ones((2, 4)), replicated)
    large = jax.device_put(jax.numpy.ones((8, 4)), replicated)
    assert small.sharding is large.sharding
    with jts.axis_rules({"a": ["fsdp", None], "b": None}):
        for _ in range(2):
            assert isinstance(small, A)
            assert not isinstance(large, A)


def test_cached_resolution_sees_the_context_mesh(mesh_explicit_ft):
    # A single-device array has no mesh of its own: the context mesh decides
    # whether the rule's axis exists.
    A = Float[Array, "a", jts.Logical]
    x = jax.device_put(jax.numpy.ones(8))
    with jts.axis_rules({"a": "fsdp"}):
        assert not isinstance(x, A)  # no mesh: sharded over fsdp, it cannot be
        other = make_mesh((8,), ("data",), "explicit")
        with jax.set_mesh(other), pytest.raises(jts.ShardingAnnotationError):
            isinstance(x, A)
        with jax.set_mesh(mesh_explicit_ft):
            assert not isinstance(x, A)
