"""The pytest plugin: forced CPU devices, never overriding the user's count."""

import os
import re

import jax
import pytest

from .helpers import run_child_pytest


def _run_pytest(tmp_path, test_body, *args, env_extra=None, ini=""):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")
    }
    env.update(env_extra or {})
    return run_child_pytest(
        tmp_path, test_body, *args, name="test_probe.py", ini=ini, env=env
    )


COUNT = """
import jax
def test_count():
    assert len(jax.devices()) == {n}
"""


def test_project_runs_on_eight_devices():
    assert len(jax.devices()) == 8


def test_option_forces_devices(tmp_path):
    out = _run_pytest(tmp_path, COUNT.format(n=4), "--jax-cpu-devices", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    # XLA_FLAGS if JAX is not imported yet, else jax_num_cpu_devices (other
    # plugins, jaxtyping's among them, may import JAX before ours runs).
    assert re.search(
        r"jaxtyping_shard: (XLA_FLAGS .*|jax_num_cpu_devices)=4", out.stdout
    )


def test_ini_forces_devices(tmp_path):
    out = _run_pytest(tmp_path, COUNT.format(n=2), ini="jax_cpu_devices = 2")
    assert out.returncode == 0, out.stdout + out.stderr


def test_does_nothing_unless_asked(tmp_path):
    out = _run_pytest(tmp_path, COUNT.format(n=1))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "jaxtyping_shard:" not in out.stdout


def test_never_overrides_user_count(tmp_path):
    out = _run_pytest(
        tmp_path,
        COUNT.format(n=3),
        "--jax-cpu-devices",
        "8",
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kept the user's device count" in out.stdout


def test_keeps_other_xla_flags(tmp_path):
    body = """
    import os, jax
    def test_flags():
        assert "--xla_cpu_enable_fast_math=false" in os.environ["XLA_FLAGS"]
        assert len(jax.devices()) == 2
    """
    out = _run_pytest(
        tmp_path,
        body,
        "--jax-cpu-devices",
        "2",
        env_extra={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"},
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_fixture_skips_with_too_few_devices(tmp_path):
    body = """
    def test_mesh(mesh_explicit):
        pass
    """
    out = _run_pytest(tmp_path, body, "-rs", "--jax-cpu-devices", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout
    assert "this mesh needs 8 devices and JAX has 2" in out.stdout


def test_bad_ini_value(tmp_path):
    out = _run_pytest(tmp_path, COUNT.format(n=1), ini="jax_cpu_devices = many")
    assert out.returncode != 0
    assert "jax_cpu_devices = 'many'" in out.stderr


def test_fixtures(mesh_explicit, mesh_auto, mesh_2x2x2):
    from jax.sharding import AxisType

    assert dict(mesh_explicit.shape) == {"data": 4, "model": 2}
    assert set(mesh_explicit.axis_types) == {AxisType.Explicit}
    assert set(mesh_auto.axis_types) == {AxisType.Auto}
    assert dict(mesh_2x2x2.shape) == {"x": 2, "y": 2, "z": 2}


def test_mesh_4x2_parametrised(mesh_4x2, request):
    from jax.sharding import AxisType

    kind = request.node.callspec.params["mesh_4x2"]
    want = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    assert set(mesh_4x2.axis_types) == {want}
    assert dict(mesh_4x2.shape) == {"data": 4, "model": 2}


def test_mesh_4x2_covered_both_kinds(tmp_path):
    # In a pytest of its own (not by counting what earlier tests of this run
    # saw: no test may depend on another's order, and the suite runs reversed).
    body = """
    def test_mesh(mesh_4x2):
        print("KIND", sorted({t.name for t in mesh_4x2.axis_types}))
    """
    out = _run_pytest(tmp_path, body, "-s", "-q", "--jax-cpu-devices", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = sorted(re.findall(r"KIND \[(.*?)\]", out.stdout))
    assert kinds == ["'Auto'", "'Explicit'"], out.stdout


def test_skip_reason_in_default_output(tmp_path):
    # No device count asked for: the fixture skips, and says why without -rs.
    body = """
    def test_mesh(mesh_4x2):
        pass
    """
    out = _run_pytest(tmp_path, body)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 skipped" in out.stdout
    assert (
        "jaxtyping_shard: 2 tests skipped: this mesh needs 8 devices and JAX has 1; "
        "run pytest with --jax-cpu-devices 8"
    ) in out.stdout


EARLY_JAX = """
import jax

jax.devices()  # initialises the backends before our plugin runs
"""


def test_too_late_is_a_note_not_a_warning(tmp_path):
    # In a user's suite with filterwarnings = error, a warning from the plugin at
    # start-up would abort the run: it is a line in the report header instead.
    (tmp_path / "early_jax.py").write_text(EARLY_JAX)
    out = _run_pytest(
        tmp_path,
        COUNT.format(n=1),
        "-p",
        "early_jax",
        "--jax-cpu-devices",
        "4",
        # Every warning an error, but for other plugins' own (pytest-asyncio's).
        ini="filterwarnings =\n    error\n    default::pytest.PytestWarning",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "jaxtyping_shard: could not force 4 CPU devices" in out.stdout
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in out.stdout


NOISY_PLUGIN = """
import warnings

import pytest


def pytest_configure(config):
    # What pytest-asyncio does when its loop scope is unset.
    warnings.warn(pytest.PytestDeprecationWarning("set your loop scope"))
"""

WARNS = """
import warnings

def test_quiet():
    pass

def test_deprecated():
    warnings.warn("old", DeprecationWarning)
"""


def _project_filterwarnings() -> str:
    import tomllib
    from pathlib import Path

    config = tomllib.loads(
        (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    )
    filters = config["tool"]["pytest"]["ini_options"]["filterwarnings"]
    return "filterwarnings =\n" + "".join(f"    {f}\n" for f in filters)


def test_project_filterwarnings_survive_other_plugins(tmp_path):
    (tmp_path / "noisy_plugin.py").write_text(NOISY_PLUGIN)
    plain = _run_pytest(
        tmp_path, WARNS, "-p", "noisy_plugin", ini="filterwarnings = error"
    )
    if pytest.version_tuple >= (9,):  # 8.0 does not yet apply filters at start-up
        assert "INTERNALERROR" in plain.stdout + plain.stderr  # the problem
    ours = _run_pytest(
        tmp_path, WARNS, "-p", "noisy_plugin", ini=_project_filterwarnings()
    )
    both = ours.stdout + ours.stderr
    assert "INTERNALERROR" not in both, both
    assert "1 failed, 1 passed" in ours.stdout, both  # warnings still fail
    assert "DeprecationWarning: old" in ours.stdout
    assert "set your loop scope" in both  # shown, not an error
