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
        assert "inspect_sharding" not in str(
            jax.make_jaxpr(make_identity("beartype", A, A))(x)
        )
    assert "inspect_sharding" in str(jax.make_jaxpr(make_identity("beartype", A, A))(x))


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
