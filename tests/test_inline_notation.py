"""Inline sharding in the dim string: `"batch@data seq"`, `"b@(data,model)"`."""

import jax
import jaxtyping
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._layout.notation import format_inline, parse_dims
from jaxtyping_shard._layout.spec import Layout

from .helpers import CHECK_ERRORS, make_binary, make_identity, place
from .test_eager import MATCHES, MISMATCHES


@pytest.mark.parametrize(
    "dims, spec",
    [
        ("b@data e", P("data")),
        ("b@data e@model", P("data", "model")),
        ("b e@model", P(None, "model")),
        ("b@(data,model) e", P(("data", "model"))),
        ("b@( data , model ) e", P(("data", "model"))),  # spaces allowed in @( )
        ("8@data e", P("data")),  # fixed
        ("_@data e", P("data")),  # anonymous
        ("#b@data e", P("data")),  # broadcastable
        ("b=8@data e", P("data")),  # name=size
        ("b@() e", P()),  # replicated, on purpose
        ("b e@()", P()),
        ("b@( ) e", P()),
        ("b@data e@()", P("data")),
        ("b e", None),  # no `@`: plain jaxtyping, sharding unchecked
    ],
)
def test_inline_means_the_spec(dims, spec, mesh_4x2):
    inline = Float[Array, dims]
    if spec is None:
        assert not hasattr(inline, "_jts")
        return
    explicit = Float[Array, "b e", spec]
    assert inline._jts == explicit._jts
    for placed, _ in MATCHES + MISMATCHES:
        x = place(mesh_4x2, (8, 4), placed)
        assert isinstance(x, inline) == isinstance(x, explicit), placed


def test_symbolic_dim(checker, mesh_explicit):
    A = Float[Array, "b e", P("data")]
    Out = Float[Array, "b*2@data e"]
    f = make_binary(checker, A, A, Out, lambda x, y: jax.numpy.concatenate([x, y]))
    x = place(mesh_explicit, (8, 4), P("data"))
    assert f(x, x).shape == (16, 4)
    Bad = Float[Array, "b*2@model e"]
    g = make_binary(checker, A, A, Bad, lambda x, y: jax.numpy.concatenate([x, y]))
    with pytest.raises(CHECK_ERRORS):
        g(x, x)


def test_dims_after_variadic(mesh_explicit):
    A = Float[Array, "*lead seq@model"]
    assert isinstance(place(mesh_explicit, (4, 8), P(None, "model")), A)
    assert isinstance(place(mesh_explicit, (2, 4, 8), P(None, None, "model")), A)
    assert isinstance(place(mesh_explicit, (8,), P("model")), A)
    assert not isinstance(place(mesh_explicit, (2, 4, 8), P(None, "model")), A)
    B = Float[Array, "b@data ... e@model"]
    assert isinstance(place(mesh_explicit, (8, 3, 4), P("data", None, "model")), B)
    assert isinstance(place(mesh_explicit, (8, 4), P("data", "model")), B)
    assert not isinstance(place(mesh_explicit, (8, 4, 4), P("data", "model")), B)


def test_replicated_on_purpose(checker, mesh_explicit):
    A = Float[Array, "batch@() embed"]
    assert A._jts == Float[Array, "batch embed", P()]._jts
    assert Float[Array, "batch embed", P()]._jts.text == "P() (`batch@() embed`)"
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P())
    assert f(x) is x
    with pytest.raises(CHECK_ERRORS):
        f(place(mesh_explicit, (8, 4), P("data")))
    # the plain dim string checks no sharding at all
    assert isinstance(place(mesh_explicit, (8, 4), P("data")), Float[Array, "b e"])
    # replicated needs no rank, so a variadic dim may say it
    V = Float[Array, "*lead@()"]
    assert isinstance(place(mesh_explicit, (2, 4, 8), P()), V)
    assert not isinstance(place(mesh_explicit, (2, 4, 8), P(None, "model")), V)


def test_axis_named_none_is_refused_when_written():
    with pytest.raises(jts.ShardingAnnotationError) as info:
        Float[Array, "batch embed@None"]
    assert str(info.value).startswith(
        "Float[..., 'batch embed@None', ...]: `embed@None` names a mesh axis called "
        "'None'. A dim that is not sharded is written without `@` when another dim "
        "carries a sharding (`batch@data embed`), or as `name@()` (e.g. `embed@()`) "
        "to check that the whole array is replicated."
    )


def test_inline_under_checkers(checker, mesh_explicit):
    A = Float[Array, "batch@data embed"]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("data"))
    assert f(x) is x
    with pytest.raises(CHECK_ERRORS):
        f(place(mesh_explicit, (8, 4), P(None, "data")))


def test_inline_in_jit_auto(mesh_auto):
    A = Float[Array, "batch@data embed"]
    f = make_identity("beartype", A, A)
    assert jts.jit(f)(place(mesh_auto, (8, 4), P("data"))).shape == (8, 4)
    with pytest.raises(jts.ShardingTypeCheckError, match="`batch@data embed`"):
        jts.jit(f)(place(mesh_auto, (8, 4), P("model")))


BAD = [
    ("batch@ e", "has nothing after `@`"),
    ("@data e", "has no dim before `@`"),
    ("b@(data e", "opens `(` without closing it"),
    ("b@data@model e", "has `@` twice"),
    ("b@None e", "names a mesh axis called 'None'"),
    ("b@(data,None) e", "names a mesh axis called 'None'"),
    ("b@(data,) e", "ends its axis tuple with a comma"),
    ("b@data e@data", "mesh axis 'data' shards both `b@data` and `e@data`"),
    ("b@(data,data) e", "names the same mesh axis twice"),
    ("b@da-ta e", "'da-ta', which is not a Python identifier"),
    ("b@da.ta e", "'da.ta', which is not a Python identifier"),
    ("b@data) e", "has `)` or `,` outside"),
    ("b@data,model e", "has `)` or `,` outside"),
    ("*lead@data e", "shards a variadic dim"),
    ("...@data e", "shards a variadic dim"),
    ("b@1x e", "not a Python identifier"),
]


@pytest.mark.parametrize("dims, fragment", BAD)
def test_malformed_inline(dims, fragment):
    with pytest.raises(jaxtyping.AnnotationError) as info:
        Float[Array, dims]
    message = str(info.value)
    assert fragment in message
    assert "Accepted forms: `name@axis`" in message


def test_inline_and_spec_together_is_an_error():
    with pytest.raises(jts.ShardingAnnotationError, match="gives the sharding twice"):
        Float[Array, "b@data e", P("data")]


def test_repr_in_inline_notation():
    assert Float[Array, "b@data  e"].__name__.endswith("'b@data  e']")
    assert Float[Array, "b e", P("data")]._jts.text == "P('data') (`b@data e`)"
    assert Float[Array, "b@(data,model) e"]._jts.text == "`b@(data,model) e`"


def test_message_expected_beside_actual(mesh_explicit):
    A = Float[Array, "batch@data seq"]
    reason = A.__instancecheck_str__(place(mesh_explicit, (8, 16), P("model")))
    assert reason.startswith(
        "this array is sharded as `float32[8@model,16]`, not `batch@data seq` as "
        "expected by the type hint"
    )


_names = st.sampled_from(["batch", "seq", "e", "h", "d_head", "x1"])
_axes = ["data", "model", "fsdp", "x", "y", "z"]


@st.composite
def _dims_and_layout(draw):
    n = draw(st.integers(1, 6))
    kinds = draw(
        st.lists(
            st.sampled_from(["named", "fixed", "anon", "bcast", "eq"]),
            min_size=n,
            max_size=n,
        )
    )
    dims = []
    for kind in kinds:
        name = draw(_names)
        dims.append(
            {
                "named": name,
                "fixed": str(draw(st.integers(1, 64))),
                "anon": "_",
                "bcast": "#" + name,
                "eq": f"{name}={draw(st.integers(1, 9))}",
            }[kind]
        )
    variadic_at = draw(st.one_of(st.none(), st.integers(0, n)))
    if variadic_at is not None:
        dims.insert(variadic_at, draw(st.sampled_from(["*lead", "...", "*#b"])))
    free = list(draw(st.permutations(_axes)))
    entries = []
    for i in range(len(dims)):
        if i == variadic_at or not draw(st.booleans()):
            entries.append(())
        else:
            k = draw(st.integers(1, 2))
            entries.append(tuple(free[:k]))
            free = free[k:]
    if variadic_at is None:
        prefix, suffix = tuple(entries), ()
    else:
        prefix, suffix = tuple(entries[:variadic_at]), tuple(entries[variadic_at + 1 :])
    return dims, prefix, suffix, variadic_at


@settings(max_examples=300, deadline=None)
@given(_dims_and_layout())
def test_parse_format_round_trip(case):
    dims, prefix, suffix, variadic_at = case
    text = format_inline(dims, prefix, suffix, variadic_at)
    plain, layout = parse_dims(text, "test")
    assert plain == " ".join(dims)
    assert layout is not None  # a layout that shards nothing is written `@()`
    expected = Layout(prefix, suffix, "")  # normalised the same way
    assert (layout.prefix, layout.suffix) == (expected.prefix, expected.suffix)
    # and the annotation accepts it
    assert Float[Array, text]._jts == layout


def test_extending_a_jaxtyping_annotation(mesh_explicit):
    # jaxtyping prepends the new dims; the inline sharding applies to them.
    A = Float[jaxtyping.Float[Array, "e"], "b@data"]
    assert "b@data" in A.__name__
    assert isinstance(place(mesh_explicit, (8, 4), P("data")), A)
    assert not isinstance(place(mesh_explicit, (8, 4), P(None, "data")), A)
