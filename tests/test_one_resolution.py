"""One resolution of an annotation, everywhere (issue 22, item 2).

A logical annotation under rules with fallback lists means, for one array, what
the rules give for its shape and mesh. Every path must resolve it alike: the
check (`isinstance`), `shardings`, `abstract`, `explain`, `place`, `reshard`,
`check_tree`'s `like=` and `stacked=`, `jts.jit`'s derived in and out shardings
(NumPy and committed arguments, `.lower`) and `typed_shard_map` (its specs and
the check of the body's argument). Random rules (fallback lists, conflict
policies) and random shapes (dims that some candidates do not divide), on
Explicit, Auto and mixed meshes; the jitted functions are shared across
examples, so their caches are warm when the rules or shapes change.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from hypothesis import assume, example, given, HealthCheck, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


A = Float[Array, "batch embed", jts.Logical]
CANDIDATES = ["data", "model", ("data", "model"), None]


@pytest.fixture(scope="module", params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


@st.composite
def cases(draw):
    rules = {
        name: draw(st.lists(st.sampled_from(CANDIDATES), min_size=1, max_size=3))
        for name in ("batch", "embed")
    }
    conflicts = draw(st.sampled_from(["error", "first", "fallback"]))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12])) for _ in range(2))
    return rules, conflicts, shape


def _count(entry, sizes):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return int(np.prod([sizes[a] for a in axes]))


def _equivalent(a, b, ndim):
    return a.is_equivalent_to(b, ndim)


@jaxtyped(typechecker=beartype)
def _identity(x: A) -> A:
    return x


_jitted = jts.jit(_identity, in_shardings="annotations", out_shardings="annotations")


# The body's argument is checked as the global array its in_specs split. The
# return is resolved by rank (docs/logical.md): where that differs from the
# argument's layout JAX's out_specs check would refuse the identity, so it is
# off here; the result's shape then shows which specs were used.
@jts.typed_shard_map(check_vma=False)
@jaxtyped(typechecker=beartype)
def _mapped(x: A) -> A:
    return x


def _every_path(mesh, shape):
    """`{path: NamedSharding}` from every path that resolves `A` for `shape`."""
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    abstract = jax.ShapeDtypeStruct(shape, jnp.float32)
    out = {"shardings": jts.shardings({"x": abstract}, mesh, annotations={"x": A})}
    out["shardings"] = out["shardings"]["x"]
    out["abstract"] = jts.abstract(lambda: jnp.zeros(shape), mesh=mesh, annotations=A)
    out["abstract"] = out["abstract"].sharding
    (row,) = jts.explain({"x": abstract}, mesh, annotations={"x": A}).rows
    out["explain"] = NamedSharding(mesh, row.spec)
    placed = jts.place(data, A, mesh)
    out["place"] = placed.sharding
    replicated = jax.device_put(data, NamedSharding(mesh, P()))
    out["reshard"] = jts.reshard(replicated, A).sharding
    with jax.set_mesh(mesh):
        out["jit numpy"] = _jitted(data).sharding
        out["jit committed"] = _jitted(placed).sharding
        compiled = _jitted.lower(data).compile()
        out["jit lower, in"] = compiled.input_shardings[0][0]
        out["jit lower, out"] = compiled.output_shardings
        try:
            jts.spec_of(A)  # a return's spec, by rank
        except jts.ShardingAnnotationError:
            # No spec by rank (a conflict the shape alone resolves): the return
            # of a shard_map body cannot be laid out, and typed_shard_map says so.
            with pytest.raises(jts.ShardingAnnotationError):
                _mapped(placed)
            return placed, out, []
        mapped = [_mapped(placed), jax.jit(_mapped)(placed)]
    return placed, out, mapped


def test_every_path_resolves_alike(mesh, slow):
    @settings(
        max_examples=100 if slow else 10,
        deadline=None,
        derandomize=not slow,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=cases())
    # The instance, and a conflict only the sizes resolve.
    @example(case=({"batch": ["data", None], "embed": [None]}, "error", (6, 4)))
    @example(case=({"batch": ["data", "model"], "embed": ["data"]}, "error", (2, 4)))
    def run(case):
        rules, conflicts, shape = case
        with jts.axis_rules(rules, conflicts=conflicts):
            try:
                reference = jts.shardings(
                    {"x": jax.ShapeDtypeStruct(shape, jnp.float32)},
                    mesh,
                    annotations={"x": A},
                )["x"]
            except jts.ShardingAnnotationError:
                # No layout under these rules: every path says so, none guesses.
                data = np.zeros(shape, np.float32)
                for attempt in (
                    lambda: jts.place(data, A, mesh),
                    lambda: jts.reshard(
                        jax.device_put(data, NamedSharding(mesh, P())), A
                    ),
                    lambda: jts.abstract(
                        lambda: jnp.zeros(shape), mesh=mesh, annotations=A
                    ),
                ):
                    with pytest.raises(jts.ShardingAnnotationError):
                        attempt()
                with jax.set_mesh(mesh), pytest.raises(jts.ShardingAnnotationError):
                    _jitted(data)
                return
            # Rules without a fallback assign a candidate that may not divide a dim:
            # which path accepts an uneven layout is another matter than resolution.
            sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
            counts = [_count(entry, sizes) for entry in reference.spec]
            counts += [1] * (2 - len(counts))
            assume(all(n % c == 0 for n, c in zip(shape, counts)))
            placed, found, mapped = _every_path(mesh, shape)
            for path, sharding in found.items():
                assert _equivalent(sharding, reference, 2), (path, sharding, reference)
            # typed_shard_map splits the argument as resolved for its global shape
            # (the body's check, reading the in_specs, agrees); a return has no global
            # shape before its out_specs, so it is resolved by rank (docs/logical.md).
            for out in mapped:
                by_rank = [_count(e, sizes) for e in jts.spec_of(A)] + [1, 1]
                assert out.shape == tuple(
                    n // c * r for n, c, r in zip(shape, counts, by_rank)
                )
                assert _equivalent(out.sharding, NamedSharding(mesh, jts.spec_of(A)), 2)
            # The check accepts what every path made, and refuses another layout.
            assert isinstance(placed, A)
            jts.check_tree({"x": placed}, {"x": A})
            jts.check_tree({"x": placed + 1}, like={"x": placed})
            stack = jax.device_put(
                np.zeros((2, *shape), np.float32),
                NamedSharding(mesh, P(None, *reference.spec)),
            )
            jts.check_tree({"x": stack}, {"x": A}, stacked={"x": 1})
            other = NamedSharding(mesh, P(*reversed(P("data", "model"))))
            if not _equivalent(other, reference, 2) and all(n % 4 == 0 for n in shape):
                wrong = jax.device_put(placed, other)
                assert not isinstance(wrong, A)
                with pytest.raises(jts.ShardingTypeCheckError):
                    jts.check_tree({"x": wrong}, like={"x": placed})

    run()


def test_a_six_row_batch_on_four_data_devices(mesh):
    # The instance: `{"batch": ["data", None]}`, 6 rows, data=4.
    rows = np.ones((6, 4), np.float32)
    with jts.axis_rules({"batch": ["data", None], "embed": None}):
        placed = jts.place(rows, A, mesh)
        assert placed.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
        with jax.set_mesh(mesh):
            out = _jitted(placed)  # refused before: "committed to another sharding"
            np.testing.assert_array_equal(np.asarray(_jitted(rows)), rows)
        assert isinstance(out, A)
        eight = jts.place(np.ones((8, 4), np.float32), A, mesh)
        assert eight.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
        with jax.set_mesh(mesh):  # an op's out_sharding= (Explicit axes only)
            explicit = "data" in jax.sharding.get_abstract_mesh().explicit_axes
            assert jts.out_sharding(A, shape=(6, 4)) == (
                P(None, None) if explicit else None
            )
            assert jts.out_sharding(A) == (P("data", None) if explicit else None)


def test_warm_caches_follow_the_shape_and_the_rules(mesh):
    # The same function, warm on one signature, then another shape, then another
    # rules table for the same shape: each answer is a fresh function's.
    def fresh():
        return jts.jit(
            _identity, in_shardings="annotations", out_shardings="annotations"
        )

    warm = fresh()
    with jax.set_mesh(mesh):
        for rules, rows, spec in [
            ({"batch": ["data", None], "embed": None}, 8, P("data")),
            ({"batch": ["data", None], "embed": None}, 6, P()),
            ({"batch": ["model", None], "embed": None}, 6, P("model")),
            ({"batch": ["data", None], "embed": None}, 8, P("data")),
        ]:
            data = np.ones((rows, 4), np.float32)
            with jts.axis_rules(rules):
                for f in (warm, fresh()):
                    for _ in range(2):  # the second call is the speculative one
                        out = f(data)
                        assert out.sharding.is_equivalent_to(
                            NamedSharding(mesh, spec), 2
                        ), (rules, rows, out.sharding)


def test_output_shardings_use_the_result_shape(mesh):
    # A result of another shape than the argument: its fallback is resolved with
    # its own shape, found by an abstract evaluation.
    @jaxtyped(typechecker=beartype)
    def head(x: Float[Array, "rows embed", jts.Logical]) -> A:
        return jnp.broadcast_to(x.sum(), (6, x.shape[1]))

    f = jts.jit(head, in_shardings="annotations", out_shardings="annotations")
    rules = {"batch": ["data", None], "rows": "data", "embed": None}
    with jts.axis_rules(rules), jax.set_mesh(mesh):
        out = f(np.ones((8, 4), np.float32))
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
        assert isinstance(out, A)
