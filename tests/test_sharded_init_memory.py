"""The memory bound of `sharded_init`, from `compiled.memory_analysis()`.

A 4096x4096 float32 weight is 64 MiB; on the 4x2 mesh each device holds an 8 MiB
shard. Compiled init's temporaries per device must stay at most twice that.
Nothing here runs the init: the figures are the compiler's, deterministic.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxtyping_shard._drivers.init import lowering as _lowering, sharded_init as _init
from jaxtyping_shard.pytest_plugin import make_mesh


N = 4096
SHARD = N * N * 4 // 8  # bytes per device
SPEC = P("data", "model")


def _init_fn(key):
    k1, k2 = jax.random.split(key)
    return {
        "w_in": jax.random.normal(k1, (N, N)),
        "w_out": jax.random.uniform(k2, (N, N)),
        "bias": jnp.zeros(N),
    }


ANNOTATIONS = {"w_in": SPEC, "w_out": SPEC, "bias": P("model")}


def _temp_bytes(mesh) -> int:
    request = _init.Request(
        _init_fn, (jax.random.key(0),), mesh=mesh, annotations=ANNOTATIONS
    )
    compiled, _ = _init.compile_init(request)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kind", ["explicit", "auto", "mixed"])
def test_temporaries_at_most_twice_the_largest_shard(kind):
    if kind == "mixed":  # `data` Explicit, `model` Auto: auto_axes over one axis
        types = (AxisType.Explicit, AxisType.Auto)
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    else:
        mesh = make_mesh((4, 2), ("data", "model"), kind)
    assert _temp_bytes(mesh) <= 2 * SHARD


def test_plain_jit_on_explicit_mesh_materialises_whole_weights():
    # Why sharded_init exists: jit(out_shardings=...) alone, on an Explicit mesh.
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    shardings = {k: NamedSharding(mesh, v) for k, v in ANNOTATIONS.items()}
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(_init_fn, out_shardings=shardings)
            .lower(jax.random.key(0))
            .compile()
        )
    assert compiled.memory_analysis().temp_size_in_bytes >= N * N * 4  # a whole one


def test_rolled_cpu_threefry_is_what_the_lowering_choice_avoids(monkeypatch):
    # With JAX's CPU rule (a rolled loop) the same init keeps 3 shards' worth.
    assert _lowering.available()
    monkeypatch.setattr(_lowering, "unrolled_threefry_on_cpu", contextlib.nullcontext)
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    assert _temp_bytes(mesh) > 2 * SHARD


def test_lowering_swap_is_scoped_and_keeps_the_bits():
    table, primitive, _ = _lowering._internals()
    before = table[primitive]
    large = (512, 256)  # 2**17 words: over `UNROLL_FROM`
    assert large[0] * large[1] >= _lowering.UNROLL_FROM
    with _lowering.unrolled_threefry_on_cpu():
        assert table[primitive] is not before
        unrolled = jax.jit(lambda k: jax.random.normal(k, large)).lower(
            jax.random.key(7)
        )
        # A small draw keeps JAX's rolled CPU rule inside the block too (XLA on
        # JAX 0.12 compiles many small unrolled draws for minutes).
        small = jax.jit(lambda k: jax.random.normal(k, (64, 8))).lower(
            jax.random.key(7)
        )
    assert table[primitive] is before
    rolled = jax.jit(lambda k: jax.random.normal(k, large)).lower(jax.random.key(7))
    assert "while" not in unrolled.as_text() and "while" in rolled.as_text()
    assert "while" in small.as_text()
    np.testing.assert_array_equal(
        np.asarray(unrolled.compile()(jax.random.key(7))),
        np.asarray(rolled.compile()(jax.random.key(7))),
    )
    with pytest.raises(RuntimeError), _lowering.unrolled_threefry_on_cpu():
        raise RuntimeError("restored even on error")
    assert table[primitive] is before
