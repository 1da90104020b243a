"""What differs between supported releases (jaxtyping_shard/_compat.py), and the
declared floors: pyproject.toml and the constraints CI installs them with agree.

CI runs this suite at both ends of the supported range, so each branch of
`_compat` is checked against the JAX that takes it.
"""

import re
import sys
import tomllib
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array
from packaging.requirements import Requirement

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat as _compat, mesh as _mesh


ROOT = Path(__file__).resolve().parent.parent
FLOORS = ROOT / ".ci" / "floors.txt"
# Tools of the main CI run only (always their newest), not tested at a floor.
UNPINNED_EXTRAS = {"docs", "lint", "dev"}


def test_version_parsing():
    assert _compat._version("0.12.0.1") == (0, 12, 0, 1)
    assert _compat._version("0.10.2") == (0, 10, 2)
    assert _compat._version("0.11.0rc1") == (0, 11, 0)
    assert _compat._version("0.9.0.dev20260101") == (0, 9, 0)
    assert _compat.JAX_VERSION == _compat._version(jax.__version__)
    assert _compat.JAX_VERSION >= (0, 8, 1)  # the declared floor


def test_make_mesh_default_axis_type():
    with warnings.catch_warnings():
        # JAX 0.8 warns that its default will change; that is the point here.
        warnings.simplefilter("ignore", DeprecationWarning)
        mesh = jax.make_mesh((8,), ("data",))
    assert mesh.axis_types == (_compat.make_mesh_default_axis_type(),)


def test_legacy_mesh_context():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert _mesh.legacy_context_mesh() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mesh:
            inside = _mesh.legacy_context_mesh()
    assert _mesh.legacy_context_mesh() is None
    assert inside is not None and dict(inside.shape) == {"data": 4, "model": 2}
    warned = any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert warned == _compat.legacy_mesh_context_warns(), [str(w) for w in caught]


@pytest.mark.parametrize("check_vma", [True, False])
def test_varying_axes(check_vma):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    seen = {}

    def body(x):
        seen["tracked"] = _compat.vma_tracked()
        seen["x"] = _compat.varying_axes(jax.typeof(x))
        total = jax.lax.psum(x, "data")
        seen["psum"] = _compat.varying_axes(jax.typeof(total))
        return total

    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))
    jax.shard_map(
        body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=check_vma
    )(x)
    assert seen["tracked"] is check_vma
    assert seen["x"] == (frozenset({"data"}) if check_vma else frozenset())
    assert seen["psum"] == frozenset()


def _floors() -> tuple[str, dict[str, str]]:
    python = None
    pins = {}
    for line in FLOORS.read_text().splitlines():
        found = re.match(r"#\s*requires-python:\s*(\S+)", line)
        if found:
            python = found.group(1)
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    assert python is not None, f"{FLOORS} has no `# requires-python: X.Y` line"
    return python, pins


def _declared() -> tuple[str, dict[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = re.fullmatch(r">=\s*(\S+)", project["requires-python"])
    assert python, f"requires-python {project['requires-python']!r} is not `>=X.Y`"
    requirements = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra not in UNPINNED_EXTRAS:
            requirements += items
    floors: dict[str, str] = {}
    for text in requirements:
        requirement = Requirement(text)
        name = requirement.name.lower()
        if name == "jaxtyping-shard":
            continue
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{text!r} in pyproject.toml declares no `>=` floor"
        assert floors.setdefault(name, lower[0]) == lower[0], (
            f"pyproject.toml gives {name} two floors: {floors[name]}, {lower[0]}"
        )
    return python.group(1), floors


def test_floors_file_matches_pyproject():
    declared_python, declared = _declared()
    pinned_python, pinned = _floors()
    assert pinned_python == declared_python, (
        f"requires-python is >={declared_python} but {FLOORS.name} tests "
        f"Python {pinned_python}"
    )
    assert pinned == declared, (
        "pyproject.toml's floors and the pins in .ci/floors.txt differ (CI tests the "
        "pins: change both together): pyproject "
        f"{ {k: v for k, v in declared.items() if pinned.get(k) != v} }, floors.txt "
        f"{ {k: v for k, v in pinned.items() if declared.get(k) != v} }"
    )


def test_running_python_is_supported():
    declared_python, _ = _declared()
    floor = tuple(int(p) for p in declared_python.split("."))
    assert sys.version_info[: len(floor)] >= floor


def test_set_user_context_global():
    context = jax.make_user_context(None)
    assert _compat.get_user_context_global(context) is None
    _compat.set_user_context_global(context, "everywhere")
    try:
        assert context.value == "everywhere"
        assert _compat.get_user_context_global(context) == "everywhere"
        with context("here"):
            assert context.value == "here"
            assert _compat.get_user_context_global(context) == "everywhere"
        assert context.value == "everywhere"
    finally:
        _compat.set_user_context_global(context, None)
    assert context.value is None


def test_fresh_values_have_a_mesh():
    expected = {(0, 8): False, (0, 10): True}.get(_compat.JAX_VERSION[:2])
    if expected is not None:  # the ends of the range CI runs; others: whichever
        assert _compat.fresh_values_have_a_mesh() is expected


def test_mesh_scope_puts_an_abstract_mesh_of_any_size_in_context():
    pod = jax.sharding.AbstractMesh(
        (512, 8), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    small = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(small):  # a concrete mesh of another size around it
        with _compat.mesh_scope(pod):
            assert jax.sharding.get_abstract_mesh() == pod
            assert _mesh.set_concrete_mesh() is None
        assert _mesh.set_concrete_mesh() is small
    with _compat.mesh_scope(small):
        assert _mesh.set_concrete_mesh() is small


def test_eager_hot_path_reads_the_sharding_of_jax_arrays_directly():
    # The eager check tells a `jax.Array` by its class and reads `_sharding`
    # (the `sharding` property costs 4x): at every supported JAX the class must be
    # the arrays' own and the attribute the property's object, or the hot path
    # silently becomes the general one (or worse, reads another object).
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))
    assert type(x) is _compat.ARRAY_IMPL
    assert type(jnp.ones(3)) is _compat.ARRAY_IMPL
    assert x._sharding is x.sharding
    # And the check itself, through the fast path: a pass, a cached pass, then an
    # array of the same shape on another sharding refused after the cached pass.
    A = jts.Float[Array, "b e", P("data", None)]
    assert isinstance(x, A) and isinstance(x, A)
    y = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "model")))
    assert not isinstance(y, A)
    assert isinstance(x, A)
