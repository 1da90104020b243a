"""Differential tests: our verdict equals JAX's own `is_equivalent_to`.

Random meshes (1 to 3 axes, sizes multiplying to 8, 4 or 2, size-1 axes
included), random actual shardings of random arrays, random expected specs. The
verdict must equal `NamedSharding(mesh, expected).is_equivalent_to(actual, ndim)`
eagerly, in jit with Explicit axes, and in jit with Auto axes. 300 examples per
mode; `pytest --slow` runs 3000.
"""

import jax
import jax.numpy as jnp
from hypothesis import example, given, HealthCheck, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import no_transfers


NAMES = ("data", "model", "fsdp")


def _factorisations(n, parts):
    if parts == 1:
        return [(n,)]
    return [
        (d,) + rest
        for d in range(1, n + 1)
        if n % d == 0
        for rest in _factorisations(n // d, parts - 1)
    ]


@st.composite
def meshes(draw):
    n = draw(st.sampled_from([8, 8, 8, 4, 2]))
    parts = draw(st.integers(1, 3))
    shape = draw(st.sampled_from(_factorisations(n, parts)))
    return shape, NAMES[:parts]


@st.composite
def specs(draw, names, ndim):
    """A random spec: each mesh axis shards one dim or none, in random order."""
    per_dim = [[] for _ in range(ndim)]
    for name in draw(st.permutations(names)):
        where = draw(st.integers(-1, ndim - 1))
        if where >= 0:
            per_dim[where].append(name)
    entries = [
        None if not e else e[0] if len(e) == 1 and draw(st.booleans()) else tuple(e)
        for e in per_dim
    ]
    trim = draw(st.integers(0, ndim))  # trailing Nones may be left out
    while trim and entries and entries[-1] is None:
        entries.pop()
        trim -= 1
    return P(*entries)


@st.composite
def cases(draw):
    shape, names = draw(meshes())
    ndim = draw(st.integers(1, 3))
    dims = tuple(draw(st.sampled_from([8, 16])) for _ in range(ndim))
    actual = draw(specs(names, ndim))
    if draw(st.integers(0, 3)):
        expected = draw(specs(names, ndim))
    else:
        expected = actual  # equal a quarter of the time, to exercise matches
    return shape, names, dims, actual, expected


def _mesh(shape, names, kind):
    n = 1
    for s in shape:
        n *= s
    return jax.make_mesh(
        shape, names, axis_types=(kind,) * len(shape), devices=jax.devices()[:n]
    )


def _setup(case, kind):
    shape, names, dims, actual, expected = case
    mesh = _mesh(shape, names, kind)
    x = jax.device_put(jnp.zeros(dims), NamedSharding(mesh, actual))
    truth = NamedSharding(mesh, expected).is_equivalent_to(x.sharding, len(dims))
    annotation = Float[Array, " ".join(f"d{i}" for i in range(len(dims))), expected]
    return x, annotation, truth


def _settings(slow):
    return settings(
        max_examples=3000 if slow else 300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=not slow,
    )


# Regression examples: cases that are easy to get wrong.
_SIZE1 = ((8, 1), ("data", "model"), (8, 8), P("data"), P("data", "model"))
_ORDER = (
    (2, 2, 2),
    ("data", "model", "fsdp"),
    (8,),
    P(("data", "model")),
    P(("model", "data")),
)
_TUPLE1 = ((4, 2), ("data", "model"), (8, 8), P(("data",)), P("data", None))
_REPL = ((2,), ("data",), (8,), P(), P(None))


def _property(slow):
    """The hypothesis test decorator, with the regression examples."""

    def decorate(run):
        for case in (_REPL, _TUPLE1, _ORDER, _SIZE1):
            run = example(case)(run)
        return _settings(slow)(given(cases())(run))

    return decorate


def test_eager(slow):
    truths = []

    @_property(slow)
    def run(case):
        x, annotation, truth = _setup(case, AxisType.Explicit)
        truths.append(truth)
        with no_transfers():
            assert isinstance(x, annotation) == truth

    run()
    # Not vacuous: both verdicts are common among the generated cases.
    assert 0.15 < sum(truths) / len(truths) < 0.85


def test_jit_explicit(slow):
    @_property(slow)
    def run(case):
        x, annotation, truth = _setup(case, AxisType.Explicit)
        seen = []

        def f(y):
            seen.append(isinstance(y, annotation))
            return y

        with no_transfers():
            jax.jit(f).trace(x)
        assert seen == [truth]

    run()


def test_jit_auto(slow):
    @_property(slow)
    def run(case):
        x, annotation, truth = _setup(case, AxisType.Auto)

        def f(y):
            assert isinstance(y, annotation)  # unknown at trace time: scheduled
            return y + 1

        with no_transfers():
            try:
                jts.jit(f)(x)
            except jts.ShardingTypeCheckError:
                verdict = False
            else:
                verdict = True
        assert verdict == truth

    run()
