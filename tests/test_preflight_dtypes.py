"""`preflight` and `explain` count each dtype's bytes as XLA stores it: every
dtype JAX has, on Explicit and Auto meshes, against `memory_analysis()`.

XLA packs the types narrower than a byte (int4, uint4, float4_e2m1fn: 2 per
byte; int2, uint2: 4 per byte), whole arrays and each device's shard, rounded
up to a byte; NumPy's `itemsize` says 1 for each of them.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Shaped
from jaxtyping_shard.pytest_plugin import make_mesh


def _every_dtype() -> dict:
    """Each dtype the installed `jax.numpy` names (its scalar types), once."""
    found = {}
    for name in sorted(dir(jnp)):
        value = getattr(jnp, name)
        dtype = getattr(value, "dtype", None) if isinstance(value, type) else None
        if isinstance(dtype, np.dtype) and dtype != np.dtype(object):
            found.setdefault(str(dtype), dtype)
    return found


DTYPES = _every_dtype()
# Refused at some of the releases tested, and compared with `memory_analysis()`
# like every other dtype where they compile: the float6 types by XLA's CPU
# backend at the floor and at 0.10 ("Invalid XLA PrimitiveType"; jaxlib 0.12 compiles
# them, one byte an element), a sharded uint1 by StableHLO (its sharding custom call
# takes no `ui1`). Any other refusal fails the test.
MAY_REFUSE = {"float6_e2m3fn", "float6_e3m2fn", "uint1"}
# The bits XLA stores an element in, where NumPy's itemsize says otherwise.
PACKED = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}

Rows = Shaped[Array, "r@data c"]  # (12, 5): a (3, 5) shard, 15 elements
Both = Shaped[Array, "r@data c@model"]  # (8, 6): a (2, 3) shard, 6 elements
Whole = Shaped[Array, "n", P()]  # (3,): 3 elements on every device


def step_one(a: Rows, b: Both, c: Whole) -> Rows:
    return a


def step_three(a: Rows, b: Both, c: Whole) -> tuple[Rows, Both, Whole]:
    return a, b, c


def arguments(dtype, mesh):
    def at(shape, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    return (
        at((12, 5), P("data", None)),
        at((8, 6), P("data", "model")),
        at((3,), P()),
    )


def xla_bytes(fn, args):
    # `keep_unused`: jit drops the arguments a step never reads from XLA's
    # program; each still takes its bytes on the device, as preflight counts.
    memory = jax.jit(fn, keep_unused=True).lower(*args).compile().memory_analysis()
    return memory.argument_size_in_bytes, memory.output_size_in_bytes


def expected(bits: int) -> dict:
    """Bytes per device of each leaf: its elements' bits, rounded up to a byte."""
    return {n: -(-n * bits // 8) for n in (15, 6, 3)}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_every_dtype_counts_as_xla_stores_it(kind):
    mesh = make_mesh((4, 2), ("data", "model"), kind)
    compared, refused = [], []
    for name, dtype in DTYPES.items():
        args = arguments(dtype, mesh)
        # With x64 off JAX warns that a 64-bit type is truncated (it counts as
        # stored, 32 bits): a warning, whatever filter an earlier test left.
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                xla_args, xla_one = xla_bytes(step_one, args)
                _, xla_three = xla_bytes(step_three, args)
                # On Auto axes preflight compiles the step on this mesh too.
                one = jts.preflight(step_one, *args, mesh=mesh)
                three = jts.preflight(step_three, *args, mesh=mesh)
            except Exception as error:  # refused: named, never passed over
                assert name in MAY_REFUSE, f"{name}: {error}"
                refused.append(name)
                continue
        assert one.argument_bytes == xla_args, name
        # One result leaf is the result itself; several are a tuple, which holds
        # one 8-byte buffer pointer per leaf on CPU.
        assert one.output_bytes == xla_one, name
        assert three.output_bytes + 8 * 3 == xla_three, name
        assert not one.unknown and not three.unknown, name
        stored = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))  # x64 off: 32 bits
        bits = PACKED.get(name, 8 * stored.itemsize)
        per_leaf = [leaf.bytes_per_device for leaf in three.leaves[:3]]
        assert per_leaf == list(expected(bits).values()), name
        compared.append(name)
    # Every packed type was compared, not passed over.
    assert set(PACKED) <= set(compared), sorted(set(PACKED) - set(compared))
    # Every dtype was either compared or refused by name, none passed over.
    assert sorted(compared + refused) == sorted(DTYPES)


@pytest.mark.parametrize("name", sorted(PACKED))
def test_explain_packs_sub_byte_types(name):
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    dtype = DTYPES[name]
    tree = {
        "rows": jax.ShapeDtypeStruct((12, 5), dtype),
        "whole": jax.ShapeDtypeStruct((3,), dtype),
    }
    annotations = {"rows": Rows, "whole": Whole}
    rows = {r.path: r for r in jts.explain(tree, mesh, annotations=annotations).rows}
    size = {n: -(-n * PACKED[name] // 8) for n in (3, 15, 60)}  # n elements
    assert rows["['rows']"].bytes_per_device == size[15]
    assert rows["['whole']"].bytes_per_device == size[3]
    # Replicated: 8 shards of 3 elements, less one copy of the array.
    assert rows["['whole']"].bytes_replicated == 8 * size[3] - size[3]
    # The rows' 8 shards (4 of 15 elements over `data`, twice) less one copy.
    assert rows["['rows']"].bytes_replicated == 8 * size[15] - size[60]
