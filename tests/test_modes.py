"""Modes: check (default), warn, off; by function and by environment variable."""

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, make_identity, place


def test_default_is_check():
    assert jts.get_mode() == "check"


def test_warn_mode(checker, mesh_explicit):
    A = Float[Array, "b e", P("data")]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with jts.set_mode("warn"):
        with pytest.warns(jts.ShardingWarning, match="8@model"):
            assert f(x) is x


def test_off_mode_skips_sharding_only(checker, mesh_explicit):
    A = Float[Array, "b e", P("data")]
    f = make_identity(checker, A, A)
    x = place(mesh_explicit, (8, 4), P("model"))
    with jts.set_mode("off"):
        assert f(x) is x
        assert isinstance(x, A)
        with pytest.raises(CHECK_ERRORS):  # shapes are still jaxtyping's business
            f(place(mesh_explicit, (8,), P("model")))
    with pytest.raises(CHECK_ERRORS):
        f(x)


def test_off_mode_leaves_nothing_in_jaxpr():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    A = Float[Array, "b e", P("data")]
    x = place(mesh, (8, 4), P("data"))
    # Fresh functions: JAX caches traces, and the mode is read when tracing.
    with jts.set_mode("off"):
        assert "jts_check_sharding" not in str(
            jax.make_jaxpr(make_identity("beartype", A, A))(x)
        )
    assert "jts_check_sharding" in str(
        jax.make_jaxpr(make_identity("beartype", A, A))(x)
    )


def test_warn_mode_at_compile_time(mesh_auto):
    A = Float[Array, "b e", P("data")]
    f = make_identity("beartype", A, A)
    x = place(mesh_auto, (8, 4), P("model"))
    with jts.set_mode("warn"), pytest.warns(jts.ShardingWarning, match="XLA sharded"):
        assert jts.jit(f)(x).shape == (8, 4)


def test_set_mode_restores_as_context_manager():
    with jts.set_mode("warn"):
        assert jts.get_mode() == "warn"
        with jts.set_mode("off"):
            assert jts.get_mode() == "off"
        assert jts.get_mode() == "warn"
    assert jts.get_mode() == "check"


def test_bad_mode():
    with pytest.raises(ValueError, match="'loud' is not a mode"):
        jts.set_mode("loud")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, expected", [("off", "off"), ("WARN", "warn"), ("", "check")]
)
def test_environment_variable(value, expected):
    code = "import jaxtyping_shard as j; print(j.get_mode())"
    env = dict(os.environ, JAXTYPING_SHARD_MODE=value)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == expected, out.stderr


def test_bad_environment_variable():
    code = "import jaxtyping_shard"
    env = dict(os.environ, JAXTYPING_SHARD_MODE="sometimes")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "JAXTYPING_SHARD_MODE='sometimes' is not a mode" in out.stderr


def test_scoped_modes_are_per_thread():
    # Issue 9, item 11: two `with set_mode(...)` blocks overlapping across threads
    # restored a stale mode and could leave the process in "off" for good.
    import threading

    entered = threading.Barrier(2)
    seen = {}

    def worker(name, mode):
        with jts.set_mode(mode):
            entered.wait()
            seen[name] = jts.get_mode()
            entered.wait()
        seen[name + " after"] = jts.get_mode()

    threads = [
        threading.Thread(target=worker, args=("a", "off")),
        threading.Thread(target=worker, args=("b", "warn")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "off", "b": "warn", "a after": "check", "b after": "check"}
    assert jts.get_mode() == "check"


def test_scopes_closed_out_of_order():
    # Generators (and coroutines) can close scopes in any order.
    def scoped(mode):
        with jts.set_mode(mode):
            yield

    outer, inner = scoped("off"), scoped("warn")
    next(outer)
    next(inner)
    assert jts.get_mode() == "warn"
    outer.close()  # the outer scope ends first
    assert jts.get_mode() == "warn"
    inner.close()
    assert jts.get_mode() == "check"


def test_async_tasks_leave_no_stale_mode():
    import asyncio

    async def task(mode, delay):
        with jts.set_mode(mode):
            await asyncio.sleep(delay)
            return jts.get_mode()

    async def main():
        # "off" ends first, while "warn" is still open: exits out of order.
        return await asyncio.gather(task("off", 0.01), task("warn", 0.03))

    results = asyncio.run(main())
    assert set(results) <= {"off", "warn"}  # tasks of one thread share its scopes
    assert jts.get_mode() == "check"


def test_bare_set_mode_is_the_process_default():
    import threading

    seen = []
    jts.set_mode("warn")
    thread = threading.Thread(target=lambda: seen.append(jts.get_mode()))
    thread.start()
    thread.join()
    with jts.set_mode("off"):
        other = threading.Thread(target=lambda: seen.append(jts.get_mode()))
        other.start()
        other.join()
        assert jts.get_mode() == "off"
    assert seen == ["warn", "warn"]  # a scope stays in its own thread
    assert jts.get_mode() == "warn"


def test_scope_closed_in_another_thread_is_refused():
    import threading

    setter = jts.set_mode("off")
    setter.__enter__()
    errors = []

    def close():
        try:
            setter.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=close)
    thread.start()
    thread.join()
    assert errors and "closed in the thread that opened it" in errors[0]
    setter.__exit__(None, None, None)
    assert jts.get_mode() == "check"
