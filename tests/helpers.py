"""Test helpers: checked functions built for each supported checker form."""

import contextlib

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
