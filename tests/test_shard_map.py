"""Inside shard_map: annotations describe the global array (local x mesh sizes)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_binary, make_identity, place


def _run(mesh, body, x, in_spec=P("data"), out_spec=P("data")):
    return jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)


def test_global_shape_matches(checker, mesh_4x2):
    A = Float[Array, "batch embed", P("data", None)]
    inner = make_identity(checker, A, A)
    x = place(mesh_4x2, (8, 4), P("data"))
    out = jax.jit(lambda v: _run(mesh_4x2, inner, v))(x)
    assert out.shape == (8, 4)


def test_same_binding_inside_and_outside(checker, mesh_explicit):
    # "batch" is bound to 8 by the outer argument; inside, the local 2 x 4 = 8.
    A = Float[Array, "batch embed", P("data", None)]
    inner = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("data"))
    outer = make_binary(checker, A, A, A, lambda a, b: _run(mesh_explicit, inner, a))
    assert outer(x, x).shape == (8, 4)


def test_local_shape_mismatch(checker, mesh_explicit):
    # Annotated as 16 rows globally; the shard is 2 of 8.
    inner = make_identity(
        checker, Float[Array, "16 embed", P("data", None)], Float[Array, "..."]
    )
    x = place(mesh_explicit, (8, 4), P("data"))
    with pytest.raises(CHECK_ERRORS):
        _run(mesh_explicit, inner, x)


def test_shape_message_names_local_and_global(mesh_explicit):
    A = Float[Array, "16 embed", P("data", None)]
    reasons = []

    def body(v):
        reasons.append(A.__instancecheck_str__(v))
        return v

    _run(mesh_explicit, body, place(mesh_explicit, (8, 4), P("data")))
    assert "the local shard `float32[2,4]`" in reasons[0]
    assert "gives `float32[8,4]`" in reasons[0]


def test_after_psum_is_not_sharded(checker, mesh_explicit):
    Sharded = Float[Array, "b e", P("data", None)]
    Replicated = Float[Array, "b e", P()]
    after_psum_sharded = make_identity(checker, Float[Array, "b e"], Sharded)
    after_psum_replicated = make_identity(checker, Float[Array, "b e"], Replicated)
    x = place(mesh_explicit, (8, 4), P("data"))

    def bad(v):
        return after_psum_sharded(jax.lax.psum(v, "data"))

    def good(v):
        return after_psum_replicated(jax.lax.psum(v, "data"))

    with pytest.raises(CHECK_ERRORS):
        _run(mesh_explicit, bad, x, out_spec=P())
    out = _run(mesh_explicit, good, x, out_spec=P())
    assert out.shape == (2, 4)


def test_varying_but_annotated_replicated(mesh_explicit):
    A = Float[Array, "b e", P()]
    reasons = []

    def body(v):
        reasons.append(A.__instancecheck_str__(v))
        return v

    _run(mesh_explicit, body, place(mesh_explicit, (8, 4), P("data")))
    assert "it varies over 'data', which the spec does not shard over" in reasons[0]


def test_not_varying_but_annotated_sharded(mesh_explicit):
    A = Float[Array, "b e", P("data")]
    reasons = []

    def body(v):
        s = jax.lax.psum(v, "data")
        reasons.append(A.__instancecheck_str__(s))
        return s

    _run(mesh_explicit, body, place(mesh_explicit, (8, 4), P("data")), out_spec=P())
    assert "it does not vary over 'data'" in reasons[0]


def test_two_axes(mesh_explicit):
    A = Float[Array, "b e", P("data", "model")]
    B = Float[Array, "b e", P("data", None)]
    seen = []

    def body(v):
        seen.append((A.__instancecheck_str__(v), isinstance(v, B)))
        return v

    x = place(mesh_explicit, (8, 4), P("data", "model"))
    _run(
        mesh_explicit, body, x, in_spec=P("data", "model"), out_spec=P("data", "model")
    )
    assert seen == [("", False)]
