"""`jts.jit` speculation at its limits: alternating signatures, static and
keyword arguments, threads, arguments moved on every call, and what the flat
jit serves instead; each answer must be the one a fresh function gives."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._drivers.jit import entry as _jit_entry

from .helpers import place
from .speculation import (
    annotated_jit,
    apply,
    args_on,
    Ordinary,
    want,
    X,
)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(request.param,) * 2)


def test_alternating_signatures_back_off(mesh, monkeypatch):
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    _, big = args_on(mesh, batch=16)
    ordinary = Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        for _ in range(_jit_entry.STALE_LIMIT + 4):
            for value in (x, big):
                out = f(m, value)
                np.testing.assert_allclose(np.asarray(out), want(m, value), rtol=1e-6)
        assert f._stale == _jit_entry.STALE_LIMIT and not f._last
        calls = 2 * (_jit_entry.STALE_LIMIT + 4)
        assert ordinary.count == calls
        # Still checked, through the flat jits now.
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(m, place(mesh, (16, 4), P()))
    assert all(e._flat is not None for e in f._cache.values())


def test_static_and_keyword_arguments_after_warm_speculation(mesh):
    @jaxtyped(typechecker=beartype)
    def scaled(x: X, scale: float = 1.0) -> X:
        return x * scale

    f = jts.jit(scaled, in_shardings="annotations", static_argnums=1)
    _, x = args_on(mesh)
    with jax.set_mesh(mesh):
        f(x, 2.0)
        f(x, 2.0)
        np.testing.assert_allclose(np.asarray(f(x, 3.0)), 3 * np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x, scale=5.0)), 5 * np.asarray(x))
        np.testing.assert_allclose(np.asarray(f(x, 3.0)), 3 * np.asarray(x))
        with pytest.raises(jts.ShardingTypeCheckError, match="`x` is"):
            f(place(mesh, (8, 4), P()), 3.0)


def test_threads_with_different_signatures(mesh):
    # Each thread's speculation is its own; a stale one in one thread never lets
    # another thread's wrong argument through.
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    _, big = args_on(mesh, batch=16)
    wrong = place(mesh, (8, 4), P())
    errors: list = []

    def run(value, bad):
        try:
            with jax.set_mesh(mesh):
                for _ in range(10):
                    out = f(m, value)
                    np.testing.assert_allclose(
                        np.asarray(out), want(m, value), rtol=1e-6
                    )
                    if bad is not None:
                        with pytest.raises(jts.ShardingTypeCheckError):
                            f(m, bad)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=args)
        for args in ((x, None), (big, None), (x, wrong))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_the_flat_jit_serves_what_speculation_cannot(mesh):
    # Host arrays every call: nothing committed, nothing to speculate on; the
    # flat jit serves each call, with the derived placement.
    f = annotated_jit(apply)
    m, x = args_on(mesh)
    host = np.asarray(x)
    with jax.set_mesh(mesh):
        for _ in range(2):
            out = f(m, host)
            assert out.sharding.spec == P("data", "model")
    assert not f._last
    (entry,) = f._cache.values()
    assert entry._flat is not None and entry._tree is None


def test_arguments_moved_on_every_call_stop_speculating(mesh):
    # reshard_inputs=True with an argument placed otherwise each time: the first
    # speculative call (the previous signature's) is refused before the ordinary
    # path moves it; a signature whose arguments must be moved is never
    # speculated on, so no more tries.
    f = annotated_jit(apply, reshard_inputs=True)
    m, x = args_on(mesh)
    rows = place(mesh, (8, 4), P())
    with jax.set_mesh(mesh):
        f(m, x)
        for _ in range(_jit_entry.STALE_LIMIT + 3):
            out = f(m, rows)
            assert out.sharding.spec == P("data", "model")
            np.testing.assert_allclose(np.asarray(out), want(m, x), rtol=1e-6)
    assert f._stale == 1 and not f._last


def test_uncommitted_unannotated_arguments_keep_speculating(mesh, monkeypatch):
    # A scale made at top level each step (uncommitted, no sharding asked for):
    # JAX's C++ cache places it as on the first call, no Python of ours.
    @jaxtyped(typechecker=beartype)
    def scaled(x: X, s: Float[Array, ""]) -> X:
        return x * s

    f = annotated_jit(scaled)
    _, x = args_on(mesh)
    ordinary = Ordinary(f, monkeypatch)
    with jax.set_mesh(mesh):
        for i in range(_jit_entry.STALE_LIMIT + 3):
            s = jnp.float32(i)
            np.testing.assert_allclose(np.asarray(f(x, s)), i * np.asarray(x))
    assert ordinary.count == 1 and f._stale == 0
