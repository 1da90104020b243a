"""Issue 35: `unreduced` and `reduced` in the type.

JAX's gradient accumulation on Explicit axes: the weights `reduced` over data,
the gradients `unreduced` over data through the micro-batch scan, one
all-reduce per step. Annotated, in the `P` form, inline (`{U:data}`, as
`jax.typeof` prints it) and logically; checked eagerly and at trace time; refused
with the reason on Auto axes and inside `shard_map`.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P, reshard
from jaxtyping import Array
from typeguard import typechecked

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core import compat as _compat

from .helpers import CHECK_ERRORS, no_transfers, place


W = Float[Array, "e m {R:data}"]  # the parameters, reduced over data
G = Float[Array, "e m {U:data}"]  # their gradients, unreduced over data
PLAIN = Float[Array, "e m", P(None, None)]
X = Float[Array, "b e", P("data", None)]
UNREDUCED_P = P(None, None, unreduced={"data"})
REDUCED_P = P(None, None, reduced={"data"})


def _loss(w, xb):
    return jnp.sum(xb @ w)


# -- item 1: annotations, in every spelling


def test_the_spellings_are_one_layout():
    by_spec = Float[Array, "e m", UNREDUCED_P]
    assert by_spec._jts == G._jts
    assert jts.spec_of(G) == jts.spec_of(by_spec) == UNREDUCED_P
    assert jts.spec_of(W) == REDUCED_P
    assert jts.spec_of(Float[Array, "e@model m {U:(data,x), R:y}"]) == P(
        "model", None, unreduced={"data", "x"}, reduced={"y"}
    )
    # Shown in JAX's notation, both ways round.
    assert "`e m {U:data}`" in by_spec._jts.text
    assert G._jts.text == "`e m {U:data}`"
    assert G._jts != PLAIN._jts and G._jts != W._jts


@pytest.mark.parametrize(
    "dims, message",
    [
        ("e m {U:}", "is not a list of unreduced / reduced axes"),
        ("e m {X:data}", "is not a list of unreduced / reduced axes"),
        ("e m {U:data,U:x}", "is not a list of unreduced / reduced axes"),
        ("e {U:data} m", "braces stand only in the dim string's last token"),
        ("e@data m {U:data}", "mesh axis 'data' shards `e@data`"),
        ("e m {U:data, R:data}", "both unreduced and reduced over 'data'"),
    ],
)
def test_malformed_inline_is_refused_when_written(dims, message):
    with pytest.raises(jts.ShardingAnnotationError, match=message):
        Float[Array, dims]


def test_logical_names_resolve_through_the_rules(mesh_explicit):
    A = Float[Array, "embed mlp", jts.Logical(unreduced=("batch",))]
    with jts.axis_rules({"batch": "data", "embed": None, "mlp": "model"}):
        assert jts.spec_of(A) == P(None, "model", unreduced={"data"})
        sharding = jts.sharding_of(A, mesh_explicit)
        assert sharding.spec == P(None, "model", unreduced={"data"})
    with jts.axis_rules({"embed": None, "mlp": None}):
        with pytest.raises(jts.ShardingAnnotationError, match="'batch' in unreduced="):
            jts.spec_of(A)
    with pytest.raises(jts.ShardingAnnotationError, match="not a logical name"):
        jts.Logical(unreduced=("no such",))


def test_a_jax_without_them_is_named(monkeypatch):
    class OldSpec(tuple):  # a PartitionSpec that takes no `unreduced=`
        def __new__(cls, *parts):
            return tuple.__new__(cls, parts)

    monkeypatch.setattr(jax.sharding, "PartitionSpec", OldSpec)
    message = _compat.pending_axes_missing.__wrapped__(("unreduced",))
    assert "has no `PartitionSpec(unreduced=...)`" in message
    assert "JAX 0.8.1" in message
    monkeypatch.undo()
    assert _compat.pending_axes_missing(("unreduced", "reduced")) == ""


def test_logical_verdicts_eager_and_traced(mesh_explicit):
    LW = Float[Array, "embed mlp", jts.Logical(reduced=("batch",))]
    LG = Float[Array, "embed mlp", jts.Logical(unreduced=("batch",))]
    rules = {"batch": "data", "embed": None, "mlp": "model"}
    w = place(mesh_explicit, (4, 2), P(None, "model"))
    x = place(mesh_explicit, (8, 4), P("data"))
    seen = []

    def f(w, x):
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)
        seen.extend([isinstance(g, LG), isinstance(w, LW), isinstance(g, LW)])
        seen.append(LG.__instancecheck_str__(w))
        return g

    with jts.axis_rules(rules), jax.set_mesh(mesh_explicit):
        wr = jts.reshard(w, LW)
        assert wr.sharding.spec == P(None, "model", reduced={"data"})
        assert [isinstance(v, LW) for v in (wr, w)] == [True, False]
        jax.jit(f).trace(wr, x)
    assert seen[:3] == [True, True, False]
    assert (
        "is not unreduced over 'data' as P(None, 'model', unreduced={'data'})"
        in (seen[3])
    )
    assert "'batch': 'data'" in seen[3]  # the rule that named the axis


# -- item 2: the verdict, eager and at trace time


def test_eager_verdicts_match_jax(mesh_explicit):
    w = place(mesh_explicit, (4, 2), P())
    wr = place(mesh_explicit, (4, 2), REDUCED_P)

    @jax.jit
    def unreduced(w, x):
        return jnp.einsum("bi,bo->io", x, x @ w, out_sharding=UNREDUCED_P)

    with jax.set_mesh(mesh_explicit):
        g = unreduced(w, place(mesh_explicit, (8, 4), P("data")))
    assert jax.typeof(g).sharding.spec.unreduced == {"data"}
    with no_transfers():
        assert [isinstance(g, a) for a in (G, PLAIN, W)] == [True, False, False]
        assert [isinstance(wr, a) for a in (W, PLAIN, G)] == [True, True, False]
        assert [isinstance(w, a) for a in (W, PLAIN, G)] == [False, True, False]
        why = PLAIN.__instancecheck_str__(g)
    assert why.startswith(
        "this array `float32[4,2]{U:data}` is unreduced over 'data' (a sum is "
        "still pending)"
    )
    assert "not reduced over 'data' as `e m {R:data}`" in W.__instancecheck_str__(w)
    # JAX's `is_equivalent_to` ignores `reduced`: the verdict does not.
    assert wr.sharding.is_equivalent_to(w.sharding, 2)


def test_traced_verdicts_explicit(mesh_explicit):
    seen = []

    def f(w, x):
        wr = reshard(w, REDUCED_P)
        g = jax.grad(_loss)(wr, x)
        plain = jax.grad(_loss)(w, x)
        seen.append([isinstance(v, a) for v in (wr, g, plain) for a in (W, G, PLAIN)])
        seen.append(G.__instancecheck_str__(plain))
        return g

    w, x = place(mesh_explicit, (4, 2), P()), place(mesh_explicit, (8, 4), P("data"))
    with jax.set_mesh(mesh_explicit), no_transfers():
        jax.jit(f).trace(w, x)
    assert seen[0] == [True, False, True, False, True, False, False, False, True]
    assert seen[1].startswith(
        "this traced array `float32[4,2]` is not unreduced over 'data' as "
        "`e m {U:data}` in the type hint declares: its sum was already taken"
    )
    assert "checked at trace time" in seen[1]


def test_refused_on_auto_axes(mesh_auto, checker):
    f = _typed(checker, accumulate)
    w = place(mesh_auto, (4, 2), P())
    reason = G.__instancecheck_str__(w)
    assert "`Auto` axes of the mesh" in reason
    assert "only on `Explicit` axes" in reason
    with pytest.raises(CHECK_ERRORS, match="`Auto` axes of the mesh"):
        f(w, w)
    with jax.set_mesh(mesh_auto), pytest.raises(CHECK_ERRORS, match="`Auto` axes"):
        jax.jit(f)(w, w)


def test_refused_inside_shard_map(mesh_explicit):
    seen = []

    def body(x):
        seen.append(W.__instancecheck_str__(x))
        return x

    x = place(mesh_explicit, (4, 2), P())
    with jax.set_mesh(mesh_explicit):
        jax.jit(jax.shard_map(body, in_specs=P(), out_specs=P())).trace(x)
    assert "manual axes here (inside `shard_map`)" in seen[0]


# -- JAX's documented pattern, annotated, and the dropped tag


def _typed(checker, f):
    """`f` checked by `checker` under `jts.jaxtyped` (the reason first)."""
    if checker == "beartype":
        return jts.jaxtyped(typechecker=beartype)(f)
    return jts.jaxtyped(typechecker=None)(typechecked(f))


def micro_grad(w: W, xb: X) -> G:
    return jax.grad(_loss)(w, xb)


def accumulate(acc: G, g: G) -> G:
    return acc + g


def reduced_in_the_loop(g: PLAIN) -> G:
    return reshard(g, P(None, None))


def _step(checker, mark: bool):
    grad_of, add = _typed(checker, micro_grad), _typed(checker, accumulate)

    def step(w, xs):
        if mark:
            w = reshard(w, REDUCED_P)
        acc = jnp.zeros(w.shape, w.dtype, out_sharding=jts.out_sharding(G))

        def body(acc, xb):
            g = grad_of(w, xb)
            assert jax.typeof(g).sharding.spec.unreduced == {"data"}
            return add(acc, g), None

        acc, _ = jax.lax.scan(body, acc, xs)
        return reshard(acc, P(None, None))  # the one all-reduce of the step

    return step


def test_jax_pattern_checked_at_trace_time(mesh_explicit, checker):
    w = place(mesh_explicit, (4, 2), P())
    xs = place(mesh_explicit, (2, 8, 4), P(None, "data"))
    with jax.set_mesh(mesh_explicit):
        step = jax.jit(_step(checker, mark=True))
        grads = step(w, xs)
        compiled = step.lower(w, xs).compile().as_text()
    expected = jnp.einsum("kbi,kbo->io", xs, jnp.ones((2, 8, 2)))
    assert jnp.allclose(grads, expected)
    assert compiled.count("all-reduce(") == 1


def test_dropped_reduced_tag_fails_by_type(mesh_explicit, checker):
    # The parameters not marked `reduced`: each micro-batch's gradient is
    # reduced inside the loop (an all-reduce per micro-batch), caught by type.
    w = place(mesh_explicit, (4, 2), P())
    xs = place(mesh_explicit, (2, 8, 4), P(None, "data"))
    with jax.set_mesh(mesh_explicit), pytest.raises(CHECK_ERRORS) as info:
        jax.jit(_step(checker, mark=False))(w, xs)
    text = str(info.value)
    head = text.split("is not")[0]  # the culprit, named first
    assert re.search('argument [`"]w[`"]', head), head
    assert "not reduced over 'data' as `e m {R:data}`" in text


def test_gradient_reduced_inside_the_loop_fails_at_return(mesh_explicit, checker):
    # A reshard inside the loop drops the unreduced tag: the result fails.
    f = _typed(checker, reduced_in_the_loop)
    x = place(mesh_explicit, (4, 2), P())
    with jax.set_mesh(mesh_explicit), pytest.raises(CHECK_ERRORS) as info:
        jax.jit(f)(x)
    text = str(info.value)
    assert "the return value" in text.split("is not")[0]
    assert "not unreduced over 'data' as `e m {U:data}`" in text


# -- item 4: the collectives of the step: one all-reduce over data, or one per
# micro-batch when the tag is dropped (the parameters not marked reduced)


def _plain_step(mark: bool):
    def step(w, xs):
        if mark:
            w = reshard(w, REDUCED_P)
        spec = jts.out_sharding(G) if mark else P(None, None)
        acc = jnp.zeros(w.shape, w.dtype, out_sharding=spec)

        def body(acc, xb):
            return acc + jax.grad(_loss)(w, xb), None

        return reshard(jax.lax.scan(body, acc, xs)[0], P(None, None))

    return jax.jit(step)


def test_collectives_one_reduction_per_step(mesh_explicit):
    w = place(mesh_explicit, (4, 2), P())
    xs = place(mesh_explicit, (4, 8, 4), P(None, "data"))
    budget = [{"kind": "all-reduce", "axes": "data", "inside": ["_loss"]}]
    with jax.set_mesh(mesh_explicit):
        deferred = jts.collectives(_plain_step(True), w, xs)
        dropped = jts.collectives(_plain_step(False), w, xs)
    ((once,),) = [deferred.where(kind="all-reduce", axes="data").rows]
    assert once.executions == 1  # outside the micro-batch loop
    ((per_micro,),) = [dropped.where(kind="all-reduce", axes="data").rows]
    assert per_micro.executions == 4  # one per micro-batch
    if not _compat.hlo_stack_frames_usable():
        return  # JAX 0.8 keeps no functions to select by (tests/test_collectives)
    deferred.check(forbid=budget)
    with pytest.raises(jts.CollectiveBudgetError, match=r"test_unreduced\.py:\d+"):
        dropped.check(forbid=budget)
