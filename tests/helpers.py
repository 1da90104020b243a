"""Test helpers: checked functions built for each supported checker form."""

import contextlib
import importlib.util
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import typeguard
from beartype import beartype
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import jaxtyped
from typeguard import typechecked

from jaxtyping_shard.pytest_plugin import make_mesh


CHECKERS = ("beartype", "typeguard")
# What a failed check raises: jaxtyping's error under `jaxtyped(typechecker=
# beartype)`; typeguard's own under `jaxtyped(typechecker=None)` + `@typechecked`.
CHECK_ERRORS = (jaxtyping.TypeCheckError, typeguard.TypeCheckError)


def make_identity(checker, In, Out):
    """`f(x: In) -> Out`, returning `x`, checked by `checker`."""
    if checker == "beartype":

        @jaxtyped(typechecker=beartype)
        def f(x: In) -> Out:
            return x

    elif checker == "typeguard":
        # The typeguard form that checks (see docs/getting-started.md): the
        # annotations are names, and `jaxtyped` has no typechecker of its own.
        @jaxtyped(typechecker=None)
        @typechecked
        def f(x: In) -> Out:
            return x

    else:
        raise ValueError(checker)
    return f


def make_binary(checker, A, B, Out, body=lambda x, y: x):
    """`f(x: A, y: B) -> Out`, returning `body(x, y)`."""
    if checker == "beartype":

        @jaxtyped(typechecker=beartype)
        def f(x: A, y: B) -> Out:
            return body(x, y)

    else:

        @jaxtyped(typechecker=None)
        @typechecked
        def f(x: A, y: B) -> Out:
            return body(x, y)

    return f


def place(mesh, shape, spec, dtype=jnp.float32):
    """An array of `shape` placed on `mesh` as `spec` (made outside any guard)."""
    x = jnp.arange(int(jnp.prod(jnp.array(shape))), dtype=dtype).reshape(shape)
    return jax.device_put(x, NamedSharding(mesh, spec))


@contextlib.contextmanager
def no_transfers():
    """Checks must never copy, move or synchronise array data."""
    with jax.transfer_guard("disallow"):
        yield


class Compiles:
    """Counts XLA compiles while in use (JAX's compile event, in this thread's
    process): `with Compiles() as compiles: ...; assert compiles.count == 1`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        self._on = True

        def listen(event, duration, **kwargs):
            if self._on and event == self.EVENT:
                self.count += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        self._on = False


def fetched(x):
    """Whether `x`'s values were ever copied to the host.

    On CPU, `transfer_guard` cannot see a device-to-host copy (the data already is
    in host memory). JAX caches the NumPy copy it makes in `_npy_value` (a private
    attribute, read only here): None means no value was ever fetched.
    """
    return x._npy_value is not None


__all__ = ["P", "CHECKERS", "CHECK_ERRORS", "make_identity", "make_binary", "place"]


def mixed_mesh():
    """A 4x2 mesh of the 8 devices, `data` Explicit and `model` Auto."""
    devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
    kinds = (AxisType.Explicit, AxisType.Auto)
    return Mesh(devices, ("data", "model"), axis_types=kinds)


# The 4x2 ("data", "model") meshes a feature claimed on every kind of axes is
# tested on: `@pytest.fixture(params=list(MESHES))`.
MESHES = {
    "explicit": lambda: make_mesh((4, 2), ("data", "model"), "explicit"),
    "auto": lambda: make_mesh((4, 2), ("data", "model"), "auto"),
    "mixed": mixed_mesh,
}


def run_child_pytest(tmp_path, source, *args, name="test_step.py", ini="", env=None):
    """Runs pytest on `source` (one test file, dedented) in `tmp_path`, in a
    child process with a `pytest.ini` of its own (`ini`: more lines of it), and
    returns the finished process (its stdout holds the report)."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    (tmp_path / "pytest.ini").write_text(f"[pytest]\n{ini}\n" if ini else "[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def one_line_mutant(example, old, new, path, module_name):
    """The file `example` with `old` (found once in it) replaced by `new` on the
    same line (`old=""`: unchanged), written at `path` and imported as
    `module_name`: a planted bug whose line keeps its number."""
    before = example.read_text()
    if old:
        assert before.count(old) == 1, old
    after = before.replace(old, new) if old else before
    changed = [a for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(changed) == (1 if old else 0)
    assert len(before.splitlines()) == len(after.splitlines())
    path.write_text(after)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
