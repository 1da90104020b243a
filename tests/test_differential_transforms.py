"""Differential tests under transformations: the verdict on a value reached through
random stacks of `jit`, `grad`, `lax.scan`, `lax.cond`, `jax.checkpoint` and
`vmap` (random `in_axes`; the annotation describes one example) equals JAX's
`is_equivalent_to` on that value, with Explicit and with Auto axes.

The random meshes, shardings and specs are those of test_differential.py. 30
examples per mesh kind by default, 300 with `pytest --slow`.
"""

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from beartype import beartype
from hypothesis import example, given, HealthCheck, settings, strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import no_transfers
from .test_differential import _mesh, cases


TRANSFORMS = ("jit", "grad", "scan", "cond", "checkpoint", "vmap")


def _grad(h):
    return lambda v: jax.grad(lambda u: h(u).sum())(v)


def _scan(h):
    return lambda v: lax.scan(lambda c, _: (h(c), None), v, None, length=2)[0]


def _cond(h):
    # The predicate is traced but never batched (vmap of a batched predicate is a
    # select, which JAX itself refuses for sharded operands).
    return lambda v: lax.cond(jnp.zeros(()) == 0, h, lambda u: h(u) * 2, v)


WRAP = {
    "jit": jax.jit,
    "grad": _grad,
    "scan": _scan,
    "cond": _cond,
    "checkpoint": jax.checkpoint,
}


@st.composite
def transformed_cases(draw):
    case = draw(cases())
    depth = draw(st.integers(1, 3))
    stack = [draw(st.sampled_from(TRANSFORMS)) for _ in range(depth)]
    first = stack.index("vmap") if "vmap" in stack else -1
    # One vmap at most: the annotation then describes one example.
    stack = [t if t != "vmap" or i == first else "jit" for i, t in enumerate(stack)]
    in_axis = draw(st.integers(0, len(case[2])))
    return case, tuple(stack), in_axis


def _checked(annotation):
    @jaxtyped(typechecker=beartype)
    def f(x: annotation) -> Float[Array, "..."]:
        return x * 2

    return f


def _build(stack, in_axis, checked):
    """The transformed function, outermost transformation first."""
    h = checked
    for name in reversed(stack):
        if name == "vmap":
            h = jax.vmap(h, in_axes=in_axis, out_axes=in_axis)
        else:
            h = WRAP[name](h)
    return h


def _value(mesh, dims, spec, stack, in_axis):
    """The per-example value placed as `spec`, batched (unsharded) under vmap."""
    if "vmap" not in stack:
        return jax.device_put(jnp.ones(dims), NamedSharding(mesh, spec))
    entries = list(spec) + [None] * (len(dims) - len(spec))
    entries.insert(in_axis, None)
    shape = dims[:in_axis] + (2,) + dims[in_axis:]
    return jax.device_put(jnp.ones(shape), NamedSharding(mesh, P(*entries)))


def _verdict(case, stack, in_axis, kind):
    shape, names, dims, actual, expected = case
    mesh = _mesh(shape, names, kind)
    x = jax.device_put(jnp.ones(dims), NamedSharding(mesh, actual))
    truth = NamedSharding(mesh, expected).is_equivalent_to(x.sharding, len(dims))
    annotation = Float[Array, " ".join(f"d{i}" for i in range(len(dims))), expected]
    value = _value(mesh, dims, actual, stack, in_axis)
    f = _build(stack, in_axis, _checked(annotation))
    with jax.set_mesh(mesh), no_transfers():
        try:
            jts.jit(f)(value)
        except jaxtyping.TypeCheckError:  # ShardingTypeCheckError included
            return truth, False
    return truth, True


_MESH = ((4, 2), ("data", "model"))
# Regression examples: each transformation alone, on a match and a mismatch.
_EXAMPLES = [
    ((*_MESH, (8, 8), actual, P("data")), (t,), axis)
    for t in TRANSFORMS
    for actual, axis in ((P("data"), 1), (P("model"), 0))
]


def _property(slow):
    def decorate(run):
        for args in _EXAMPLES:
            run = example(args)(run)
        return settings(
            max_examples=300 if slow else 30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            derandomize=not slow,
        )(given(transformed_cases())(run))

    return decorate


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_transformations(kind, slow):
    truths = []

    @_property(slow)
    def run(args):
        case, stack, in_axis = args
        truth, verdict = _verdict(case, stack, in_axis, kind)
        truths.append(truth)
        assert verdict == truth, (stack, in_axis)

    run()
    assert 0.1 < sum(truths) / len(truths) < 0.9  # both verdicts are exercised
