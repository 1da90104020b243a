"""`jts.fsdp`, `jts.Used`, `jts.as_used`: a weight annotated once, as stored; its
"as used" form (FSDP axes gathered) derived from the rules table."""

import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_identity, MESHES


L = jts.Logical
W = Float[Array, "embed mlp", L]
Hidden = Float[Array, "batch seq embed", L]
FSDP_TP = {"batch": "data", "seq": None, "embed": jts.fsdp("data"), "mlp": "model"}
# FSDP over every device: the batch and the stored weights take both axes.
FSDP = {
    "batch": ("data", "model"),
    "seq": None,
    "embed": jts.fsdp("data", "model"),
    "mlp": None,
}


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return MESHES[request.param]()


class Mlp(eqx.Module):
    w_in: W
    w_out: Float[Array, "mlp embed", L]
    bias: Float[Array, " mlp", P("model")]  # physical: as written
    scale: Float[Array, " embed"]  # no sharding: left alone


def _mlp(mesh):
    module = Mlp(jnp.ones((8, 16)), jnp.ones((16, 8)), jnp.ones(16), jnp.ones(8))
    return jts.reshard(module)


# -- the rules table ----------------------------------------------------------


def test_fsdp_rule_reads_as_fallback_where_stored_and_none_where_used():
    rules = jts.AxisRules(FSDP_TP)
    assert rules.candidates("embed") == (("data",), ())
    assert rules.gathered == frozenset({"embed"})
    used = rules.as_used()
    assert used.candidates("embed") == ((),)
    assert used.candidates("mlp") == (("model",),)  # tensor parallelism stays
    assert rules.as_used() is used  # cached
    assert "jts.fsdp('data')" in repr(rules)
    # Not the same table as the fallback list it reads as where stored.
    plain = jts.AxisRules({**FSDP_TP, "embed": ["data", None]})
    assert plain != rules and plain.as_used() is plain


def test_fsdp_in_linen_pairs():
    rules = jts.AxisRules([("batch", "data"), ("embed", jts.fsdp("data"))])
    assert rules.candidates("embed") == (("data",), ())
    assert rules.as_used().candidates("embed") == ((),)
    assert "('embed', jts.fsdp('data'))" in rules.describe()


@pytest.mark.parametrize(
    "bad, needle",
    [
        ((), "needs the mesh axes"),
        (("data", "data"), "twice"),
        (("",), "not a mesh axis name"),
        ((3,), "not a mesh axis name"),
    ],
)
def test_malformed_fsdp_fails_when_written(bad, needle):
    with pytest.raises(jts.ShardingAnnotationError, match=needle):
        jts.fsdp(*bad)


def test_fsdp_inside_a_fallback_list_is_refused():
    with pytest.raises(jts.ShardingAnnotationError, match="whole rule"):
        jts.AxisRules({"embed": [jts.fsdp("data"), None]})


def test_flax_rules_give_the_stored_axes():
    assert jts.flax_rules(FSDP_TP) == (
        ("batch", "data"),
        ("seq", None),
        ("embed", "data"),
        ("mlp", "model"),
    )


# -- resolution: one annotation, two forms ------------------------------------


@pytest.mark.parametrize(
    "rules, stored, used, hidden",
    [
        (FSDP_TP, P("data", "model"), P(None, "model"), P("data", None, None)),
        (
            FSDP,
            P(("data", "model"), None),
            P(None, None),
            P(("data", "model"), None, None),
        ),
    ],
    ids=["fsdp_tp", "fsdp"],
)
def test_one_annotation_resolves_stored_used_and_activation(
    mesh, rules, stored, used, hidden
):
    with jax.set_mesh(mesh), jts.axis_rules(rules):
        assert jts.spec_of(W, (8, 16)) == stored
        assert jts.spec_of(jts.Used[W], (8, 16)) == used
        # An activation's `embed`: its `batch` already holds the FSDP axes.
        assert jts.spec_of(Hidden, (8, 4, 8)) == hidden
        assert jts.spec_of(jts.Used[Hidden], (8, 4, 8)) == hidden


def test_without_fsdp_rules_used_means_the_annotation():
    rules = {"embed": "data", "mlp": "model"}
    with jts.axis_rules(rules):
        assert jts.spec_of(jts.Used[W], (8, 16)) == jts.spec_of(W, (8, 16))


# -- the annotation -----------------------------------------------------------


def test_used_is_one_object_per_annotation_and_pickles():
    assert jts.Used[W] is jts.Used[W]
    assert jts.Used[jts.Used[W]] is jts.Used[W]
    import numpy as np

    N = Float[np.ndarray, "embed mlp", L]  # jax.Array itself does not pickle
    again = pickle.loads(pickle.dumps(jts.Used[N]))
    with jts.axis_rules(FSDP_TP):
        assert jts.spec_of(again, (8, 16)) == P(None, "model")


@pytest.mark.parametrize(
    "annotation, needle",
    [
        (Float[Array, "e m", P("data", "model")], "is physical"),
        (Float[Array, "e@data m"], "is physical"),
        (Float[Array, "e m"], "has no sharding"),
        (int, "has no sharding"),
    ],
)
def test_used_of_what_it_cannot_derive_fails_when_written(annotation, needle):
    with pytest.raises(jts.ShardingAnnotationError, match=needle):
        jts.Used[annotation]


def test_used_is_not_called():
    with pytest.raises(TypeError, match="subscripted"):
        jts.Used()


def test_used_of_a_union_keeps_its_members():
    import numpy as np

    U = Float[Array | np.ndarray, "embed mlp", L]
    with jts.axis_rules(FSDP_TP):
        assert jts.spec_of(jts.Used[U], (8, 16)) == P(None, "model")


@pytest.mark.parametrize("checker", ["beartype", "typeguard"])
def test_used_checks_eagerly_both_ways(mesh, checker):
    gathered = make_identity(checker, jts.Used[W], jts.Used[W])
    stored = make_identity(checker, W, W)
    with jax.set_mesh(mesh), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((8, 16)), W)
        whole = jts.reshard(w, jts.Used[W])
        assert whole.sharding.spec == P(None, "model")
        gathered(whole)
        stored(w)
        with pytest.raises(CHECK_ERRORS):
            gathered(w)  # still split over FSDP
        with pytest.raises(CHECK_ERRORS):
            stored(whole)  # the stored weight gathered: FSDP lost


def test_used_checked_in_jit_through_the_caches(mesh):
    @jts.jit
    @jts.jaxtyped(typechecker=beartype)
    def use(w: jts.Used[W]) -> jts.Used[W]:
        return w * 2

    with jax.set_mesh(mesh), jts.axis_rules(FSDP_TP):
        w = jts.reshard(jnp.ones((8, 16)), W)
        whole = jts.reshard(w, jts.Used[W])
        use(whole)  # warm
        with pytest.raises((jts.ShardingTypeCheckError, *CHECK_ERRORS)):
            use(w)
    # The same stored layout, under rules with no FSDP name: now it is as used.
    with jax.set_mesh(mesh), jts.axis_rules({**FSDP_TP, "embed": "data"}):
        use(w)


# -- as_used ------------------------------------------------------------------


def test_as_used_gathers_fsdp_only(mesh):
    with jax.set_mesh(mesh), jts.axis_rules(FSDP_TP):
        module = _mlp(mesh)
        assert module.w_in.sharding.spec == P("data", "model")
        used = jts.as_used(module)
        assert used.w_in.sharding.spec == P(None, "model")
        assert used.w_out.sharding.spec == P("model", None)
        assert used.bias.sharding.spec == P("model")  # physical: as written
        assert used.scale is module.scale  # unannotated: untouched
        w = jts.as_used(module.w_in, W)
        assert w.sharding.spec == P(None, "model")


def test_as_used_in_jit_and_its_gradient_comes_back_stored(mesh):
    def loss(module, x):
        used = jts.as_used(module)
        h = jts.einsum("bse,em->bsm", x, used.w_in) + used.bias
        return jts.einsum("bsm,me->bse", h, used.w_out).sum()

    with jax.set_mesh(mesh), jts.axis_rules(FSDP_TP):
        module = _mlp(mesh)
        x = jts.reshard(jnp.ones((8, 4, 8)), Hidden)
        grads = jax.jit(jax.grad(loss))(module, x)
        jts.check_tree(grads, name="grads")  # laid out as stored
    plain = jax.device_get((module, x))  # the same math, on one device

    def plain_loss(m, x):
        h = jnp.einsum("bse,em->bsm", x, m.w_in) + m.bias
        return jnp.einsum("bsm,me->bse", h, m.w_out).sum()

    want = jax.grad(plain_loss)(*plain)
    assert jnp.allclose(jax.device_get(grads.w_in), want.w_in)
    assert jnp.allclose(jax.device_get(grads.w_out), want.w_out)


# -- einsum -------------------------------------------------------------------


def test_einsum_derives_a_row_parallel_result(mesh_explicit):
    mesh = mesh_explicit
    with jax.set_mesh(mesh):
        h = jax.device_put(jnp.arange(128.0).reshape(8, 16), P("data", "model"))
        w = jax.device_put(jnp.ones((16, 4)), P("model", None))
        with pytest.raises(Exception, match="out_sharding"):
            jnp.einsum("bm,me->be", h, w)  # what JAX says without it
        y = jts.einsum("bm,me->be", h, w)
        assert y.sharding.spec == P("data", None)
        assert jnp.allclose(y, jnp.einsum("bm,me->be", *jax.device_get((h, w))))
        # A given out_sharding is used as given.
        z = jts.einsum("bm,me->be", h, w, out_sharding=P("data", "model"))
        assert z.sharding.spec == P("data", "model")


def test_einsum_names_an_fsdp_weight_used_without_its_gather(mesh_explicit):
    with jax.set_mesh(mesh_explicit):
        h = jax.device_put(jnp.ones((8, 16)), P("data", "model"))
        w = jax.device_put(jnp.ones((16, 4)), P("model", "data"))  # not gathered
        with pytest.raises(jts.ShardingAnnotationError, match="as_used"):
            jts.einsum("bm,me->be", h, w)
        with pytest.raises(jts.ShardingAnnotationError, match="without `...`"):
            jts.einsum("...m,me->...e", h, jax.device_put(w, P("model", None)))


def test_einsum_leaves_auto_axes_and_plain_contractions_to_jax(mesh_auto):
    with jax.set_mesh(mesh_auto):
        h = jax.device_put(jnp.ones((8, 16)), P("data", "model"))
        w = jax.device_put(jnp.ones((16, 4)), P("model", None))
        y = jax.jit(lambda a, b: jts.einsum("bm,me->be", a, b))(h, w)
        assert jnp.allclose(y, 16.0)
    x = jnp.ones((2, 3))
    assert jts.einsum("ij,jk->ik", x, x.T).shape == (2, 2)  # no mesh at all
