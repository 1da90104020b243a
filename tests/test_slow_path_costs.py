"""Costs found by profiling the compile-time figures (benchmarks/README.md), kept
fixed: the library directories are not recomputed at every frame of a stack walk,
and the compile-time check is lowered inline (no function per check)."""

import os
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir  # the lowering cache's private set
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._core import site
from jaxtyping_shard._verdict import compiles, primitive

from .helpers import place


def test_skip_dirs_cached_until_a_module_is_imported(tmp_path, monkeypatch):
    # Whether or not the real chex was imported (optax imports it), start without.
    monkeypatch.delitem(sys.modules, "chex", raising=False)
    first = site._skip_dirs()
    assert site._skip_dirs() is first  # cached: not made afresh per frame
    # A library imported later (here: a stand-in `chex`) is skipped from then on.
    fake = types.ModuleType("chex")
    fake.__file__ = str(tmp_path / "chex" / "__init__.py")
    monkeypatch.setitem(sys.modules, "chex", fake)
    later = site._skip_dirs()
    assert str(tmp_path / "chex") + os.sep in later
    assert site.is_library_file(str(tmp_path / "chex" / "core.py"))
    monkeypatch.delitem(sys.modules, "chex")
    assert str(tmp_path / "chex") + os.sep not in site._skip_dirs()


@pytest.mark.skipif(
    not compiles._CACHEABLE, reason="this JAX has no lowering cache to opt out of"
)
def test_check_lowered_inline():
    assert primitive.check_sharding_p in mlir._uncacheable_primitives


def test_every_check_of_a_chain_still_runs(mesh_auto):
    # Inline lowering runs the rule for each equation: each of the 5 checks is
    # registered with its compile, so a wrong sharding at any link is caught.
    x = place(mesh_auto, (8, 4), P("data", None))
    for bad_link in range(5):

        def f(x, bad_link=bad_link):
            y = x
            for i in range(5):
                y = jnp.sin(y)
                spec = P("model", None) if i == bad_link else P("data", None)
                assert isinstance(y, Float[Array, "b e", spec])
            return y

        jax.clear_caches()
        wrong = (
            r"1 sharding mismatch.*test_slow_path_costs.py:\d+"
            r".*8@data,4\]`, not P\('model'"
        )
        with pytest.raises(jts.ShardingTypeCheckError, match=wrong):
            with jts.sharding_errors():
                jax.jit(f).lower(x).compile()
    jax.clear_caches()

    def ok(x):
        y = x
        for _ in range(5):
            y = jnp.sin(y)
            assert isinstance(y, Float[Array, "b e", P("data", None)])
        return y

    with jts.sharding_errors():
        jax.jit(ok).lower(x).compile()


def test_a_long_block_is_merged_into_one_call(mesh_auto):
    # A call costs XLA a small module parsed in a new MLIR context (about 3 ms),
    # and a call without results or sharding rule costs it in proportion to its
    # operands: 150 checks in one block are one call, and a mismatch anywhere in
    # it is found.
    from jaxtyping_shard._verdict import custom_call

    x = place(mesh_auto, (8, 4), P("data", None))

    def chain(bad_at: int):
        def f(x):
            y = x
            for i in range(150):
                y = jnp.sin(y)
                spec = P("model", None) if i == bad_at else P("data", None)
                assert isinstance(y, Float[Array, "b e", spec])
            return y

        return f

    jax.clear_caches()
    text = jax.jit(chain(-1)).lower(x).as_text()
    assert text.count(f"custom_call @{custom_call.CALL_TARGET}(") == 1
    assert "sdy.sharding_rule" not in text
    with jts.sharding_errors():
        jax.jit(chain(-1)).lower(x).compile()
    for bad_at in (0, 63, 64, 149):
        jax.clear_caches()
        with pytest.raises(jts.ShardingTypeCheckError, match="1 sharding mismatch"):
            with jts.sharding_errors():
                jax.jit(chain(bad_at)).lower(x).compile()


def test_shared_verdicts_never_hide_a_mismatch(mesh_auto):
    # Checks with the same annotation, shape, dtype and mesh share passing
    # verdicts (`auto._passing`), keyed by the sharding XLA chose too: of two
    # such checks, the one XLA lays out otherwise is still caught, by its own
    # line, whichever comes first; and a compile of the same program again
    # (from the shared verdicts) passes and fails alike.
    from jax.sharding import NamedSharding

    x = place(mesh_auto, (8, 4), P())
    want = Float[Array, "b e", P("data", None)]

    def program(first: P, second: P):
        def f(v):
            a = jnp.sin(
                jax.lax.with_sharding_constraint(v, NamedSharding(mesh_auto, first))
            )
            assert isinstance(a, want)  # line A
            b = jnp.cos(
                jax.lax.with_sharding_constraint(v, NamedSharding(mesh_auto, second))
            )
            assert isinstance(b, want)  # line B
            return a + b

        return f

    good, bad = P("data", None), P("model", None)
    for first, second, culprit in ((good, bad, "B"), (bad, good, "A")):
        for _ in range(2):
            jax.clear_caches()
            with pytest.raises(jts.ShardingTypeCheckError) as caught:
                with jts.sharding_errors():
                    jax.jit(program(first, second)).lower(x).compile()
            message = str(caught.value)
            assert "1 sharding mismatch" in message
            line = _line_of(f"# line {culprit}")
            assert f"test_slow_path_costs.py:{line}" in message, message
            assert "8@model" in message and "8@data" not in message
    jax.clear_caches()
    with jts.sharding_errors():
        jax.jit(program(good, good)).lower(x).compile()


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(
            i for i, text in enumerate(source, 1) if text.rstrip().endswith(marker)
        )
