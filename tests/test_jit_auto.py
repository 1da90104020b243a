"""Inside `jit` with Auto mesh axes: checked when XLA compiles."""

import jax
import jaxtyping
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import make_binary, make_identity, no_transfers, place
from .test_eager import MATCHES, MISMATCHES


@pytest.mark.parametrize("placed, spec", MATCHES)
def test_match(checker, mesh_auto, placed, spec):
    A = Float[Array, "b e", spec]
    f = jts.jit(make_identity(checker, A, A))
    x = place(mesh_auto, (8, 4), placed)
    with no_transfers():
        assert f(x).shape == (8, 4)


@pytest.mark.parametrize("placed, spec", MISMATCHES)
def test_mismatch_raw_jit(checker, mesh_auto, placed, spec):
    A = Float[Array, "b e", spec]
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_auto, (8, 4), placed)
    # Plain jax.jit raises the type-check error itself, not JAX's INTERNAL error.
    with no_transfers(), pytest.raises(jts.ShardingTypeCheckError) as info:
        jax.jit(f)(x)
    assert "argument `x`" in str(info.value)
    assert "[jaxtyping_shard #" not in str(info.value)


@pytest.mark.parametrize("placed, spec", MISMATCHES)
def test_mismatch_our_jit(checker, mesh_auto, placed, spec):
    A = Float[Array, "b e", spec]
    f = make_identity(checker, A, Float[Array, "b e"])
    x = place(mesh_auto, (8, 4), placed)
    with no_transfers(), pytest.raises(jaxtyping.TypeCheckError) as info:
        jts.jit(f)(x)
    assert isinstance(info.value, jts.ShardingTypeCheckError)
    first = str(info.value).splitlines()[0]
    assert first.startswith("1 sharding mismatch while compiling `f`: argument `x`")
    assert ".f`" in first
    assert "expected by the type hint" in first


def test_sharding_errors_context_manager(mesh_auto):
    A = Float[Array, "b e", P("model")]
    f = make_identity("beartype", A, A)
    x = place(mesh_auto, (8, 4), P("data"))
    with pytest.raises(jts.ShardingTypeCheckError, match="argument `x`"):
        with jts.sharding_errors():
            jax.jit(f)(x)


def test_other_runtime_errors_pass_through():
    with pytest.raises(ValueError, match="boom"):
        with jts.sharding_errors():
            raise ValueError("boom")


def test_typeof_none_is_not_replicated(mesh_auto):
    # jax.typeof says P(None, None) under Auto axes; P() must not pass at trace
    # time on that basis: the compile-time check finds the real sharding.
    seen = []

    def f(y):
        seen.append(jax.typeof(y).sharding.spec)
        assert isinstance(y, Float[Array, "b e", P()])  # unknown yet: scheduled
        return y

    x = place(mesh_auto, (8, 4), P("data"))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"8@data"):
        jts.jit(f)(x)
    assert seen and all(spec == P(None, None) for spec in seen)


def test_return_value_auto(checker, mesh_auto):
    A = Float[Array, "b e", P("data", None)]
    f = make_binary(
        checker, A, A, Float[Array, "b e", P("model", None)], lambda a, b: a + b
    )
    x = place(mesh_auto, (8, 4), P("data"))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.jit(f)(x, x)
    assert str(info.value).startswith(
        "1 sharding mismatch while compiling `f`: the return value of `"
    )
    ok = make_binary(
        checker, A, A, Float[Array, "b e", P("data", None)], lambda a, b: a + b
    )
    assert jts.jit(ok)(x, x).shape == (8, 4)


def test_out_shardings_respected(mesh_auto):
    A = Float[Array, "b e", P("data", None)]
    B = Float[Array, "b e", P(None, "model")]
    f = make_identity("beartype", A, B)
    g = jts.jit(
        lambda v: f(v) + 0, out_shardings=jax.NamedSharding(mesh_auto, P(None, "model"))
    )
    x = place(mesh_auto, (8, 4), P("data"))
    # The inner annotation applies to the value inside, before out_shardings.
    with pytest.raises(jts.ShardingTypeCheckError):
        g(x)


def test_unknown_axis_auto(mesh_auto):
    # An axis the mesh lacks: no match, found at trace time (nothing to compile).
    A = Float[Array, "b e", P("fsdp")]
    f = make_identity("beartype", A, A)
    with pytest.raises(jaxtyping.TypeCheckError, match="'fsdp'"):
        jax.jit(f)(place(mesh_auto, (8, 4), P("data")))


def test_reports_each_value_once(mesh_auto):
    # jaxtyped checks the parameters twice (alone, then with the return value);
    # each mismatch is reported once all the same, and nothing of the checks is
    # left in the compiled program.
    A = Float[Array, "b e", P("model", None)]
    f = make_binary("beartype", A, A, Float[Array, "b e"], lambda a, b: a + b)
    x = place(mesh_auto, (8, 4), P("data"))
    y = place(mesh_auto, (8, 4), P("data"))
    assert "jts_check_sharding" in str(jax.make_jaxpr(f)(x, y))
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.jit(f)(x, y)
    text = str(info.value)
    assert text.startswith("2 sharding mismatches while compiling `f`:")
    assert text.count("argument `x`") == 1 and text.count("argument `y`") == 1
    ok = make_binary("beartype", A, A, A, lambda a, b: a + b)
    good = place(mesh_auto, (8, 4), P("model"))
    compiled = jax.jit(ok).lower(good, good).compile().as_text()
    assert "custom-call(" not in compiled


def test_mixed_explicit_auto_mesh(checker):
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    A = Float[Array, "b e", P("data", None)]
    f = make_identity(checker, A, A)
    good = place(mesh, (8, 4), P("data"))
    assert jts.jit(f)(good).shape == (8, 4)
    # The explicit part is wrong: found at trace time, as jaxtyping's error.
    from .helpers import CHECK_ERRORS

    wrong_explicit = place(mesh, (8, 4), P())
    with pytest.raises(CHECK_ERRORS):
        jax.jit(f).trace(wrong_explicit)
    # The explicit part is right, the auto part wrong: found at compile time.
    wrong_auto = place(mesh, (8, 4), P("data", "model"))
    with pytest.raises(jts.ShardingTypeCheckError, match="model"):
        jts.jit(f)(wrong_auto)


def test_jit_wrapper_forwards(mesh_auto):
    def g(x):
        return x * 2

    f = jts.jit(g, static_argnums=())
    x = place(mesh_auto, (8, 4), P("data"))
    assert f.lower(x).compile() is not None
    assert f.__name__ == "g"
    assert f.__wrapped__ is not None
    decorated = jts.jit(static_argnums=(1,))(lambda x, n: x * n)
    assert decorated(x, 3).shape == (8, 4)


def test_our_jit_compiles_once_and_keeps_the_fast_path(mesh_auto):
    # The checks have no effect: one compile per signature, and JAX's C++ dispatch
    # (no retrace, no Python re-check) on later calls.
    traces = []
    A = Float[Array, "b e", P("data", None)]
    checked = make_identity("beartype", A, A)

    def f(x):
        traces.append(jax.typeof(x))
        return checked(x) * 2

    g = jts.jit(f)
    x = place(mesh_auto, (8, 4), P("data"))
    assert g(x).shape == (8, 4)
    assert len(traces) == 1
    for _ in range(3):
        g(x)
    assert len(traces) == 1
    assert g._cache_size() == 1
    assert "jts_check_sharding" in str(g.trace(x).jaxpr)
    # A new signature is checked, before it runs.
    with pytest.raises(jts.ShardingTypeCheckError):
        g(place(mesh_auto, (8, 4), P("model")))
    assert g(place(mesh_auto, (16, 4), P("data"))).shape == (16, 4)


def test_our_jit_keeps_user_exceptions(mesh_auto):
    A = Float[Array, "b e", P("data", None)]
    checked = make_identity("beartype", A, A)

    def f(x):
        try:
            return checked(x)
        except Exception:  # must not swallow the wrapper's internal signal
            raise AssertionError("swallowed") from None

    assert jts.jit(f)(place(mesh_auto, (8, 4), P("data"))).shape == (8, 4)


def test_our_jit_static_argument(mesh_auto):
    A = Float[Array, "b e", P("data", None)]
    checked = make_identity("beartype", A, A)
    g = jts.jit(lambda x, n: checked(x) * n, static_argnums=(1,))
    x = place(mesh_auto, (8, 4), P("data"))
    assert g(x, 2).shape == (8, 4)
    assert g(x, 3).shape == (8, 4)
    with pytest.raises(jts.ShardingTypeCheckError):
        g(place(mesh_auto, (8, 4), P("model")), 3)
