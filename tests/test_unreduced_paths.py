"""Issue 35, item 3: unreduced and reduced on every path.

`jts.jit` / `jts.filter_jit` boundaries (through their caches), `check_tree`,
`shardings`, `reshard`, `out_sharding`, `einsum`, `jts.Like["params",
jts.Unreduced("data")]`, `explain` and `preflight`.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, reshard
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import place


W = Float[Array, "e m@model {R:data}"]  # parameters: reduced over data
G = Float[Array, "e m@model {U:data}"]  # their gradients
X = Float[Array, "b e", P("data", None)]
GRAD_SPEC = P(None, "model", unreduced={"data"})
ERRORS = (jts.ShardingTypeCheckError,)


def _loss(params, x):
    return jnp.sum(x @ params["w"])


def _arrays(mesh):
    params = {"w": place(mesh, (4, 2), P(None, "model"))}
    x = place(mesh, (8, 4), P("data"))
    return params, x


@pytest.mark.parametrize("wrapper", ["jit", "filter_jit"])
def test_boundaries_through_the_cache(mesh_explicit, wrapper):
    wrap = getattr(jts, wrapper)

    @wrap
    def grads(params: dict[str, W], x: X) -> dict[str, G]:
        return jax.grad(_loss)(params, x)

    params, x = _arrays(mesh_explicit)
    with jax.set_mesh(mesh_explicit):
        marked = jts.reshard(params, {"w": W})
        assert jax.typeof(grads(marked, x)["w"]).sharding.spec == GRAD_SPEC
        # Warm: the same shapes, the same layout but for `reduced`.
        with pytest.raises(ERRORS, match=r"params\['w'\]: this traced array"):
            grads(params, x)
        assert grads(marked, x)["w"].sharding.spec == GRAD_SPEC


def test_a_result_reduced_in_the_function_fails_by_key_path(mesh_explicit):
    @jts.jit
    def grads(params: dict[str, W], x: X) -> dict[str, G]:
        g = jax.grad(_loss)(params, x)
        return jax.tree.map(lambda a: reshard(a, P(None, "model")), g)

    params, x = _arrays(mesh_explicit)
    with jax.set_mesh(mesh_explicit):
        marked = jts.reshard(params, {"w": W})
        with pytest.raises(ERRORS) as info:
            grads(marked, x)
    text = str(info.value)
    assert "return value" in text and "return['w']" in text
    assert "is not unreduced over 'data'" in text


def test_derived_shardings_carry_them(mesh_explicit):
    @jts.jit(in_shardings="annotations", out_shardings="annotations")
    def grads(params: dict[str, W], x: X) -> dict[str, G]:
        return jax.grad(_loss)(params, x)

    params, x = _arrays(mesh_explicit)
    with jax.set_mesh(mesh_explicit):
        out = grads(jts.reshard(params, {"w": W}), x)
        assert out["w"].sharding.spec == GRAD_SPEC
        with pytest.raises(ERRORS, match=r"asks for `float32\[4,2@model\]\{R:data\}`"):
            grads(params, x)  # committed, not reduced: not moved


def test_check_tree_and_shardings(mesh_explicit):
    params, x = _arrays(mesh_explicit)
    with jax.set_mesh(mesh_explicit):
        marked = jts.reshard(params, {"w": W})
        g = jax.jit(jax.grad(_loss))(marked, x)
    assert jts.check_tree({"g": g, "p": marked}, {"g": {"w": G}, "p": {"w": W}})
    with pytest.raises(ERRORS) as info:
        jts.check_tree({"g": g, "p": params}, {"g": {"w": G}, "p": {"w": W}})
    text = str(info.value)
    assert "tree['p']['w']: this array `float32[4,2@model]` is not reduced" in text
    assert "tree['g']" not in text
    specs = jts.shardings(params, mesh_explicit, annotations={"w": G})
    assert specs["w"] == NamedSharding(mesh_explicit, GRAD_SPEC)


def test_reshard_out_sharding_einsum(mesh_explicit):
    params, x = _arrays(mesh_explicit)
    seen = {}

    def f(w, x):
        seen["reshard"] = jax.typeof(jts.reshard(w, W))
        y = jnp.einsum("bi,bo->io", x, x, out_sharding=jts.out_sharding(G))
        seen["out_sharding"] = jax.typeof(y)
        seen["einsum"] = jax.typeof(jts.einsum("bi,bo->io", x, x, unreduced=True))
        seen["einsum ann"] = jax.typeof(jts.einsum("bi,bo->io", x, x, out_sharding=G))
        seen["einsum summed"] = jax.typeof(jts.einsum("bi,bo->io", x, x))
        return reshard(y, P())

    with jax.set_mesh(mesh_explicit):
        jax.jit(f).trace(params["w"], x)
        assert jts.reshard(params["w"], W).sharding.spec.reduced == {"data"}
    assert seen["reshard"].sharding.spec == P(None, "model", reduced={"data"})
    assert seen["out_sharding"].sharding.spec == GRAD_SPEC
    assert seen["einsum"].sharding.spec.unreduced == {"data"}
    assert seen["einsum ann"].sharding.spec == GRAD_SPEC
    assert not seen["einsum summed"].sharding.spec.unreduced


def test_like_params_unreduced_through_a_scan(mesh_explicit):
    Acc = jts.Like["params", jts.Unreduced("data")]

    @jts.jit
    def accumulate(params: dict[str, W], acc: Acc, xs) -> Acc:
        def body(acc, xb):
            g = jax.grad(_loss)(params, xb)
            return jax.tree.map(jnp.add, acc, g), None

        return jax.lax.scan(body, acc, xs)[0]

    params, _ = _arrays(mesh_explicit)
    xs = place(mesh_explicit, (2, 8, 4), P(None, "data"))
    with jax.set_mesh(mesh_explicit):
        marked = jts.reshard(params, {"w": W})
        zeros = jax.jit(lambda: {"w": jnp.zeros((4, 2), out_sharding=GRAD_SPEC)})()
        acc = accumulate(marked, zeros, xs)
        assert acc["w"].sharding.spec == GRAD_SPEC
        dropped = {"w": place(mesh_explicit, (4, 2), P(None, "model"))}
        with pytest.raises(ERRORS) as info:
            accumulate(marked, dropped, xs)
    assert "acc['w']: this traced array `float32[4,2@model]` is not unreduced" in str(
        info.value
    )
    with pytest.raises(jts.ShardingAnnotationError, match="jts.Unreduced"):
        jts.Like["params", "data"]


def test_explain_and_preflight_bytes(mesh_explicit):
    params, x = _arrays(mesh_explicit)
    table = jts.explain(params, mesh_explicit, annotations={"w": G})
    (row,) = table.rows
    # Each device holds a whole 4x1 shard (4 B x 4 = 16 B): 4 partial sums over
    # `data`, replicated over nothing else.
    assert (row.bytes_per_device, row.bytes_replicated) == (16, 0)
    assert "float32[4,2@model]{U:data}" in str(table)
    assert (
        jts.explain(params, mesh_explicit, annotations={"w": W})
        .rows[0]
        .bytes_replicated
        == 16 * 8 - 32
    )

    @jts.jit
    def grads(params: dict[str, W], x: X) -> dict[str, G]:
        return jax.grad(_loss)(params, x)

    with jax.set_mesh(mesh_explicit):
        report = jts.preflight(grads, jts.reshard(params, {"w": W}), x)
    assert "float32[4,2@model]{U:data}" in str(report)
    assert "float32[4,2@model]{R:data}" in str(report)


def test_drivers_refuse_them_on_auto_axes(mesh_auto):
    w = place(mesh_auto, (4, 2), P())

    @jts.jit(in_shardings="annotations")
    def step(params: dict[str, W]) -> dict[str, W]:
        return params

    attempts = {
        "sharding_of": lambda: jts.sharding_of(W, mesh_auto),
        "tree['w']": lambda: jts.shardings({"w": w}, mesh_auto, annotations={"w": W}),
        "reshard": lambda: jax.jit(lambda v: jts.reshard(v, G))(w),
        "test_drivers_refuse_them_on_auto_axes.<locals>.step: params['w']": lambda: (
            step({"w": w})
        ),
    }
    with jax.set_mesh(mesh_auto):
        for culprit, attempt in attempts.items():
            with pytest.raises(jts.ShardingAnnotationError) as info:
                attempt()
            text = str(info.value)
            assert text.startswith(culprit), text
            assert "not `Explicit` axes of the mesh" in text
        assert jts.out_sharding(G) is None  # XLA chooses on Auto axes


def test_as_used_keeps_reduced_where_the_layout_leaves_the_axis(mesh_explicit):
    # Gradient accumulation with FSDP: the weights gathered once, marked
    # reduced over data; a module's `jts.as_used` inside the scan (under rules
    # that gather nothing more) keeps them reduced, so each gradient stays
    # unreduced. A layout that shards over the axis takes the ordinary path.
    Stored = Float[Array, "embed mlp", jts.Logical]
    rules = {"embed": None, "mlp": "model", "batch": "data"}
    seen = {}

    def f(w, x):
        wr = reshard(w, P(None, "model", reduced={"data"}))
        with jts.axis_rules(rules):
            used = jts.as_used(wr, Stored)
            g = jax.grad(lambda w: jnp.sum(x @ jts.as_used(w, Stored)))(wr)
        with jts.axis_rules({**rules, "embed": "data"}):
            seen["sharded"] = jts.as_used(wr, Stored)
        seen["used"], seen["grad"] = used, g
        return g

    w = place(mesh_explicit, (4, 2), P(None, "model"))
    x = place(mesh_explicit, (8, 4), P("data"))
    with jax.set_mesh(mesh_explicit), jts.axis_rules(rules):
        jax.jit(f).trace(w, x)
        plain = jts.as_used(w, Stored)  # a concrete array: placed as used
    assert jax.typeof(seen["used"]).sharding.spec == P(None, "model", reduced={"data"})
    assert jax.typeof(seen["grad"]).sharding.spec == GRAD_SPEC
    assert jax.typeof(seen["sharded"]).sharding.spec == P("data", "model")
    assert plain.sharding.spec == P(None, "model")
