"""Checks that run when XLA compiles (mesh axes of type `Auto`), and their failures.

At trace time `schedule` binds a `jts_check_sharding` primitive (see `primitive`)
holding a `CompileTimeCheck`: the annotation, the traced value's per-example shape,
the mesh, the site (function, argument, line) and the mode, all fixed when traced,
so that a cached trace or executable replays the mode it was made in (the mode is
also part of JAX's cache key: `_core.modes`).

Lowering registers each check with the `Compile` of its module, in trace order
(`compiles`), and emits it into XLA's program (`custom_call`); XLA hands it the
sharding it chose, and `mismatch` gives the verdict.
"""

import threading
import warnings
from typing import Any, Optional

from jax.sharding import NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingTypeCheckError, ShardingWarning
from .._layout import spec as _spec
from . import custom_call as _custom_call
from .compare import equivalent, FIX, shards_nothing


class _Watching(threading.local):
    # A list while `sharded_init` traces its function: `(value, check)` for every
    # check scheduled, so that the checks of values the function returns can be
    # moved onto the concrete result (`CompileTimeCheck.on_result`).
    checks: Optional[list] = None


watching = _Watching()


class CompileTimeCheck:
    """One annotation on one traced value; hashed and compared by identity."""

    def __init__(
        self, cls: Any, aval: Any, mesh: Any, site: Any, mode: str, members=()
    ):
        self.cls = cls
        self.members = tuple(members)
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype
        self.mesh = mesh
        self.site = site
        self.mode = mode
        # True: the value is a result of `sharded_init`, checked on the concrete
        # array instead; XLA may report another layout for an internal copy of it
        # (a constant copied per user), which would be a false alarm.
        self.on_result = False
        # What the verdict depends on besides the sharding: checks that share it
        # share their passing verdicts and fingerprints (a program's checks are
        # mostly a few annotations on values of a few shapes).
        self.inputs = (cls, self.members, self.shape, self.dtype, mesh)

    def __repr__(self) -> str:
        return f"<check {self.cls._jts.text} on {self.site.describe()}>"

    def mismatch(self, sharding: Any, batch_dims: tuple[int, ...]) -> Optional[str]:
        """`None` when `sharding` (of the value, batch dims included) matches."""
        key = (self.inputs, batch_dims, sharding)
        if key in _passing:
            return None
        mismatch = self._mismatch(sharding, batch_dims)
        if mismatch is None:
            if len(_passing) >= _CACHE_LIMIT:
                _passing.clear()
            _passing[key] = None
        return mismatch

    def _mismatch(self, sharding: Any, batch_dims: tuple[int, ...]) -> Optional[str]:
        ndim = len(self.shape)
        cls = self.cls
        anyof = (cls, *self.members)  # a Union: any member whose shape fits
        if 0 in self.shape:
            # No elements, nothing laid out: XLA calls every such value replicated,
            # and every annotation describes it (eager and trace time agree).
            return None
        if isinstance(sharding, _custom_call.Maximal):
            if any(shards_nothing(m, self.mesh) for m in anyof):
                return None
            actual = (
                f"`{_spec.format_array(self.dtype, self.shape, ())}` on one device "
                f"({sharding.hlo})"
            )
        elif isinstance(sharding, _custom_call.Untileable):
            actual = (
                f"`{_spec.format_array(self.dtype, self.shape, ())}` tiled as "
                f"{sharding.hlo}, which no PartitionSpec on this mesh can write"
            )
        else:
            sharding = _drop_dims(sharding, batch_dims)
            if type(sharding) is NamedSharding:
                if any(equivalent(m, sharding.mesh, sharding, ndim) for m in anyof):
                    return None
                entries = _spec.entries_of(sharding.spec)
                actual = f"`{_spec.format_array(self.dtype, self.shape, entries)}`"
            else:
                if sharding.is_fully_replicated and any(
                    shards_nothing(m, self.mesh) for m in anyof
                ):
                    return None
                plain = _spec.format_array(self.dtype, self.shape, ())
                actual = f"`{plain}` ({sharding})"
        expected = f"{cls._jts.text} as expected by the type hint {cls.__name__}"
        if self.members:
            expected = "any member of the Union in the type hint: " + ", ".join(
                m._jts.text for m in anyof
            )
        return (
            f"{self.site.describe()}: XLA sharded it as {actual}, not {expected} "
            f"(mesh {_mesh.format_mesh(self.mesh)})"
        )

    def fingerprint(self, batch_dims: tuple[int, ...]) -> str:
        """Everything `mismatch` decides with, as text that is the same in every
        process: part of the check's key in the compiled program (`custom_call`),
        so that a program is only ever found in JAX's persistent cache under the
        checks it was compiled with. The site only words the message: left out."""
        key = (self.inputs, self.mode, self.on_result, batch_dims)
        text = _fingerprints.get(key)
        if text is None:
            if len(_fingerprints) >= _CACHE_LIMIT:
                _fingerprints.clear()
            text = _fingerprints[key] = self._fingerprint(batch_dims)
        return text

    def _fingerprint(self, batch_dims: tuple[int, ...]) -> str:
        mesh = self.mesh
        layouts = [
            (m._jts.entries(len(self.shape)), m._jts.axes)
            for m in (self.cls, *self.members)
        ]
        return repr(
            (
                self.mode,
                self.on_result,
                self.shape,
                str(self.dtype),
                batch_dims,
                tuple(mesh.axis_names),
                tuple(mesh.axis_sizes),
                tuple(str(t) for t in mesh.axis_types),
                layouts,
            )
        )

    def on_concrete(self, sharding: Any, batch_dims: tuple[int, ...]) -> None:
        """The check met a concrete array (a jaxpr evaluated eagerly)."""
        mismatch = self.mismatch(sharding, batch_dims)
        if mismatch is None or self.mode == "off":
            return
        message = f"{mismatch}. {FIX}"
        if self.mode == "warn":
            warnings.warn(message, ShardingWarning, stacklevel=2)
            return
        raise ShardingTypeCheckError(message)


# Keyed by `CompileTimeCheck.inputs` and what else decides (above). Maximal and
# Untileable shardings are keyed by identity: never found again, which is safe.
_CACHE_LIMIT = 4096
_passing: dict = {}
_fingerprints: dict = {}


def _drop_dims(sharding: Any, dims: tuple[int, ...]) -> Any:
    """The per-example sharding: `sharding` without its batch dims (from `vmap`)."""
    if not dims or type(sharding) is not NamedSharding:
        return sharding
    entries = list(sharding.spec)
    entries += [None] * (max(dims) + 1 - len(entries))
    kept = [e for i, e in enumerate(entries) if i not in dims]
    return NamedSharding(
        sharding.mesh, PartitionSpec(*kept), memory_kind=sharding.memory_kind
    )
