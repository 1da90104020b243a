"""pytest plugin: forced CPU devices for JAX, mesh fixtures, a budget of
collectives (the `check_collectives` fixture, `--update-collectives`) and a
baseline of layouts (the `check_layouts` fixture, `--update-layouts`).

Registered through the `pytest11` entry point, so it is active wherever
jaxtyping_shard is installed, but it does nothing unless asked: pass
`--jax-cpu-devices N` or set `jax_cpu_devices = N` in the pytest ini section. It
sets the count before JAX creates its backends, and never overrides a count the
user already set (`XLA_FLAGS=--xla_force_host_platform_device_count=...`,
`JAX_NUM_CPU_DEVICES`, or `jax.config.update("jax_num_cpu_devices", ...)`).

Installed in someone else's environment, it must never fail their suite: it emits
no warnings (their `filterwarnings = error` would turn one into an abort at
start-up); what it has to say goes into the report header and the terminal
summary.

This module imports nothing from jaxtyping_shard or JAX at import time.
"""

import os
import sys
from collections import Counter

import pytest


_FLAG = "--xla_force_host_platform_device_count"
_NOTE = pytest.StashKey[str]()
# The baselines a fixture holds reports to, each with its own --update-<what>
# option (rewriting the collectives' budget rewrites no golden file of layouts,
# and the other way round) and the files it rewrote, named in the summary.
_REWRITTEN = {
    "collectives": pytest.StashKey[list](),
    "layouts": pytest.StashKey[list](),
}
_SKIP_PREFIX = "jaxtyping_shard mesh fixture: "


def pytest_addoption(parser):
    group = parser.getgroup("jaxtyping_shard")
    group.addoption(
        "--jax-cpu-devices",
        dest="jax_cpu_devices",
        type=int,
        default=None,
        metavar="N",
        help="force N CPU devices for JAX (set before JAX initialises its backends)",
    )
    for what in _REWRITTEN:
        group.addoption(
            f"--update-{what}",
            dest=f"update_{what}",
            action="store_true",
            default=False,
            help=f"rewrite the baselines of {what} that tests hold steps to with "
            f"the check_{what} fixture, instead of comparing with them",
        )
    parser.addini(
        "jax_cpu_devices",
        help="force this many CPU devices for JAX (jaxtyping_shard plugin)",
        default="",
    )


def _requested(config, option: "int | None") -> "int | None":
    value = option
    if value is None:
        ini = str(config.getini("jax_cpu_devices")).strip()
        if not ini:
            return None
        try:
            value = int(ini)
        except ValueError:
            raise pytest.UsageError(
                f"jax_cpu_devices = {ini!r} in the pytest config is not a number"
            ) from None
    if value < 1:
        raise pytest.UsageError(f"--jax-cpu-devices must be at least 1, got {value}")
    return value


def _user_count() -> "str | None":
    """A device count the user set themselves, if any."""
    for piece in os.environ.get("XLA_FLAGS", "").split():
        if piece.startswith(_FLAG):
            return f"XLA_FLAGS {piece}"
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return f"JAX_NUM_CPU_DEVICES={os.environ['JAX_NUM_CPU_DEVICES']}"
    jax = sys.modules.get("jax")
    if jax is not None:
        value = jax.config.jax_num_cpu_devices
        if value is not None and value >= 0:
            return f"jax_num_cpu_devices={value}"
    return None


def force_cpu_devices(count: int) -> str:
    """Sets the CPU device count unless the user set one; says what happened."""
    already = _user_count()
    if already is not None:
        return f"kept the user's device count ({already})"
    if "jax" not in sys.modules:
        # Appended, as JAX's own test utilities do, to keep the user's other flags.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" {_FLAG}={count}"
        ).strip()
        return f"XLA_FLAGS {_FLAG}={count}"
    import jax  # not at the top: JAX must load after XLA_FLAGS is set, above

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except Exception as error:  # backends already initialised
        # A note in the report header, not a warning: see the module docstring.
        return (
            f"could not force {count} CPU devices: JAX was initialised before "
            f"pytest loaded its plugins ({error}); set XLA_FLAGS={_FLAG}={count} "
            "in the environment instead"
        )
    return f"jax_num_cpu_devices={count}"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Runs before any conftest.py (and so any test module) imports JAX.
    # Command-line options are not parsed into the config yet at this point.
    option = getattr(parser.parse_known_args(args), "jax_cpu_devices", None)
    count = _requested(early_config, option)
    if count is not None:
        early_config.stash[_NOTE] = force_cpu_devices(count)


def pytest_report_header(config):
    note = config.stash.get(_NOTE, None)
    if note is not None:
        return f"jaxtyping_shard: {note}"
    return None


def pytest_terminal_summary(terminalreporter):
    # Skips are reported as `2 skipped` unless the user asks with -rs; the reason
    # here says how to get the devices, so it is always shown (and fails nothing).
    reasons: Counter = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        found = reason.find(_SKIP_PREFIX)
        if found >= 0:
            reasons[reason[found + len(_SKIP_PREFIX) :]] += 1
    for reason, count in sorted(reasons.items()):
        tests = "test" if count == 1 else "tests"
        terminalreporter.write_line(
            f"jaxtyping_shard: {count} {tests} skipped: {reason}", yellow=True
        )
    for what, key in _REWRITTEN.items():
        rewritten = terminalreporter.config.stash.get(key, [])
        if rewritten:
            terminalreporter.write_line(
                f"jaxtyping_shard: rewrote the baseline of {what} "
                + ", ".join(sorted(set(rewritten))),
                yellow=True,
            )


def _devices(count: int):
    import jax  # not at the top: the plugin loads before the device count is set

    devices = jax.devices()
    if len(devices) < count:
        try:
            cpus = jax.devices("cpu")
        except RuntimeError:
            cpus = []
        if len(cpus) >= count:
            devices = cpus
    if len(devices) < count:
        pytest.skip(
            f"{_SKIP_PREFIX}this mesh needs {count} devices and JAX has "
            f"{len(devices)}; run "
            f"pytest with --jax-cpu-devices {count} (or jax_cpu_devices = {count} "
            "in the pytest config)"
        )
    return devices[:count]


def make_mesh(shape, names, kind: str = "explicit"):
    """A mesh over the first devices, with all axes Explicit or all Auto."""
    import math  # these three: loaded with JAX, after the device count is set

    import numpy as np  # (see above)
    from jax.sharding import AxisType, Mesh  # (see above)

    axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    devices = _devices(math.prod(shape))
    return Mesh(
        np.asarray(devices).reshape(shape), names, axis_types=(axis_type,) * len(shape)
    )


@pytest.fixture
def mesh_explicit():
    """A 4x2 `('data', 'model')` mesh with Explicit axes."""
    return make_mesh((4, 2), ("data", "model"), "explicit")


@pytest.fixture
def mesh_auto():
    """A 4x2 `('data', 'model')` mesh with Auto axes."""
    return make_mesh((4, 2), ("data", "model"), "auto")


@pytest.fixture(params=["explicit", "auto"])
def mesh_4x2(request):
    """The 4x2 `('data', 'model')` mesh, once with Explicit and once with Auto axes."""
    return make_mesh((4, 2), ("data", "model"), request.param)


@pytest.fixture
def mesh_2x2x2():
    """A 2x2x2 `('x', 'y', 'z')` mesh with Explicit axes."""
    return make_mesh((2, 2, 2), ("x", "y", "z"), "explicit")


def _held_to_baseline(request, what: str):
    """`check(report, baseline, **options)`: `report.check(baseline, ...)`, or
    under `pytest --update-<what>` the baseline rewritten for the running JAX
    release (the other bounds still hold) and named in the summary."""
    update = bool(request.config.getoption(f"update_{what}"))

    def check(report, baseline, **options):
        report.check(baseline, update=update, **options)
        if update:
            request.config.stash.setdefault(_REWRITTEN[what], []).append(
                str(baseline)
            )

    return check


@pytest.fixture
def check_collectives(request):
    """Holds a step to its budget of collectives: `check_collectives(report,
    baseline, **bounds)` calls `report.check(baseline, **bounds)` (a report of
    `jaxtyping_shard.collectives`), or, under `pytest --update-collectives`,
    rewrites the baseline file for the running JAX release (the other bounds
    still hold) and names it in the summary.
    """
    return _held_to_baseline(request, "collectives")


@pytest.fixture
def check_layouts(request):
    """Holds a step's intermediates to their layouts: `check_layouts(report,
    baseline, **options)` calls `report.check(baseline, **options)` (a report
    of `jaxtyping_shard.layouts`), or, under `pytest --update-layouts`,
    rewrites the baseline file for the running JAX release and names it in the
    summary. (Its own option: rewriting the collectives' budget rewrites no
    golden file of layouts, and the other way round.)
    """
    return _held_to_baseline(request, "layouts")
