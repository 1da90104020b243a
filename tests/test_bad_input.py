"""The bad-input table: each misuse, its exact error type, and what it says.

One row per misuse; annotation syntax errors are covered in more depth in
test_annotation_errors.py and test_inline_notation.py.
"""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float, typed_shard_map

from .helpers import make_identity, no_transfers


_MESH = {}


def mesh(kind="explicit"):
    if kind not in _MESH:
        axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
        _MESH[kind] = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)
    return _MESH[kind]


_ARRAYS = {}


def arr(spec=P("data"), shape=(8, 4), kind="explicit"):
    # Made once, before the transfer guard of the test is entered.
    key = (spec, shape, kind)
    if key not in _ARRAYS:
        _ARRAYS[key] = jax.device_put(jnp.zeros(shape), NamedSharding(mesh(kind), spec))
    return _ARRAYS[key]


def single_device():
    if "single" not in _ARRAYS:
        _ARRAYS["single"] = jnp.zeros(8)
    return _ARRAYS["single"]


def _typed_no_return():
    @typed_shard_map
    def f(x: Float[Array, "b@data e"]):
        return x


ASE = jts.ShardingAnnotationError
TCE = (jaxtyping.TypeCheckError,)
ROWS = [
    # -- the third argument
    (
        "tuple spec",
        lambda: Float[Array, "b e", ("data", None)],
        ASE,
        "Wrap the entries",
    ),
    ("str spec", lambda: Float[Array, "b e", "data"], ASE, "Wrap the axis name"),
    ("None spec", lambda: Float[Array, "b e", None], ASE, "got NoneType"),
    ("int spec", lambda: Float[Array, "b e", 0], ASE, "got int"),
    (
        "NamedSharding spec",
        lambda: Float[Array, "b e", NamedSharding(mesh(), P("data"))],
        ASE,
        "mesh is never written",
    ),
    (
        "mesh as spec",
        lambda: Float[Array, "b e", mesh()],
        ASE,
        "must be a jax.sharding.PartitionSpec",
    ),
    ("axis reused", lambda: Float[Array, "b e", P("data", "data")], ASE, "used twice"),
    (
        "axis reused in tuple",
        lambda: Float[Array, "b e", P(("data", "data"))],
        ASE,
        "used twice",
    ),
    (
        "spec longer than dims",
        lambda: Float[Array, "b e", P(None, None, "data")],
        ASE,
        "has 3 entries",
    ),
    ("non-str axis", lambda: Float[Array, "b e", P(2)], ASE, "not a mesh axis name"),
    (
        "UNCONSTRAINED",
        lambda: Float[Array, "b e", P(P.UNCONSTRAINED)],
        ASE,
        "UNCONSTRAINED",
    ),
    (
        "unreduced, inline, empty",
        lambda: Float[Array, "b e {U:}"],
        ASE,
        "is not a list of unreduced / reduced axes",
    ),
    ("scalar type", lambda: Float[float, "", P()], ASE, "needs an array type"),
    (
        "extending sharded",
        lambda: Float[Float[Array, "e", P("data")], "b"],
        ASE,
        "would drop its sharding",
    ),
    ("four arguments", lambda: Float[Array, "b", P(), P()], ASE, "got 4 arguments"),
    ("both forms", lambda: Float[Array, "b@data e", P("data")], ASE, "sharding twice"),
    # -- inline notation
    ("inline empty axis", lambda: Float[Array, "b@ e"], ASE, "nothing after `@`"),
    ("inline no dim", lambda: Float[Array, "@data e"], ASE, "no dim before `@`"),
    ("inline unclosed", lambda: Float[Array, "b@(data e"], ASE, "without closing"),
    ("inline double @", lambda: Float[Array, "b@data@model"], ASE, "`@` twice"),
    ("inline axis None", lambda: Float[Array, "b@None"], ASE, "axis called 'None'"),
    (
        "inline trailing comma",
        lambda: Float[Array, "b@(data,)"],
        ASE,
        "ends its axis tuple with a comma",
    ),
    ("inline axis twice", lambda: Float[Array, "b@data e@data"], ASE, "shards both"),
    (
        "inline bad chars",
        lambda: Float[Array, "b@da+ta"],
        ASE,
        "not a Python identifier",
    ),
    ("inline variadic", lambda: Float[Array, "*b@data"], ASE, "shards a variadic dim"),
    # -- at check time
    # An axis the mesh lacks: no match (a Union member for another mesh must be
    # free to fail), reported as a type-check failure naming the axis.
    (
        "unknown axis, eager",
        lambda: make_identity(
            "beartype", Float[Array, "b e", P("fsdp")], Float[Array, "..."]
        )(arr()),
        TCE,
        "P('fsdp')",
    ),
    (
        "unknown axis, jit",
        lambda: jax.jit(
            make_identity(
                "beartype", Float[Array, "b e", P("fsdp")], Float[Array, "..."]
            )
        ).trace(arr()),
        TCE,
        "P('fsdp')",
    ),
    (
        "unknown axis, auto",
        lambda: jax.jit(
            make_identity("beartype", Float[Array, "b e", P("x")], Float[Array, "b e"])
        ).trace(arr(kind="auto")),
        TCE,
        "P('x')",
    ),
    (
        "spec longer than rank",
        lambda: make_identity(
            "beartype", Float[Array, "*b", P("data", "model")], Float[Array, "..."]
        )(arr(shape=(8,))),
        TCE,
        "Type-check error",
    ),
    (
        "no mesh resolvable",
        lambda: make_identity(
            "beartype", Float[Array, "b", P("data")], Float[Array, "..."]
        )(single_device()),
        TCE,
        "Type-check error",
    ),
    (
        "numpy with sharded spec",
        lambda: make_identity(
            "beartype", Float[np.ndarray, "b", P("data")], Float[np.ndarray, "..."]
        )(np.zeros(8, np.float32)),
        TCE,
        "Type-check error",
    ),
    ("wrong mode", lambda: jts.set_mode("strict"), ValueError, "is not a mode"),
    # -- typed_shard_map
    (
        "typed_shard_map no annotation",
        lambda: typed_shard_map(lambda x: x),
        ASE,
        "has no annotation",
    ),
    (
        "typed_shard_map no return",
        _typed_no_return,
        ASE,
        "the return value has no annotation",
    ),
]


@pytest.mark.parametrize("name, thunk, error, fragment", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, thunk, error, fragment):
    for shape, kind in [((8, 4), "explicit"), ((8, 4), "auto"), ((8,), "explicit")]:
        arr(shape=shape, kind=kind)
    single_device()
    with no_transfers(), pytest.raises(error) as info:
        thunk()
    assert fragment in str(info.value)
    if error is ASE:
        assert type(info.value) is jts.ShardingAnnotationError
        assert isinstance(info.value, jaxtyping.AnnotationError)


def test_table_is_large_enough():
    assert len(ROWS) >= 30
