"""The layout a sharding constraint sets on a traced value, read from the equation
that produced it.

On Auto axes XLA must lay a constrained value out as constrained, so a check of
that very value is decided at trace time (see `check`): the culprit is reported
where the constraint is. Left to the compile, it would come after its victims:
XLA also propagates the constrained layout backwards, to the values upstream of
the mistake, and the compile's report lists them in trace order, first.

The constraint is JAX's own equation, whoever wrote it:
`jax.lax.with_sharding_constraint`, which `jts.reshard` uses on Auto axes. Not
`jax.device_put` inside `jit`: on Auto axes it lowers to nothing (JAX 0.10.2),
and XLA lays its result out as it likes.

An argument of a `jit` whose `in_shardings` the caller derived is laid out as
derived, too (XLA keeps the parameters' shardings it is given), and so is a
result under derived `out_shardings`. The trace cannot see them, so the caller
says it (`placed`) while it checks those leaves, and the check of that very
tracer is decided at trace time (`placed_spec`), with no compile-time check left
in the program. A result that a constraint lays out otherwise is still reported
at the constraint (above), before `placed` is asked.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Optional

from jax.interpreters.partial_eval import DynamicJaxprTracer
from jax.sharding import NamedSharding, PartitionSpec

from .._layout import spec as _spec


def constrained_spec(x: Any, mesh: Any) -> Optional[PartitionSpec]:
    """The spec a constraint on `mesh`'s axes sets `x` to, else `None` (no
    constraint produced `x`, or it leaves a dim unconstrained)."""
    x, eqn = _producer(x)
    if eqn is None:
        return None
    name = getattr(eqn.primitive, "name", None)
    params = eqn.params
    if name != "sharding_constraint" or params.get("unconstrained_dims"):
        return None
    sharding = params.get("sharding")
    if type(sharding) is not NamedSharding:
        return None
    on = sharding.mesh
    if (on.axis_names, on.axis_sizes) != (mesh.axis_names, mesh.axis_sizes):
        return None
    spec = sharding.spec
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in _spec.partitions_of(spec)):
        return None
    return spec


class _Placed(threading.local):
    value: Any = None  # the tracer being checked, while `placed` is open
    sharding: Any = None


_placed = _Placed()


@contextlib.contextmanager
def placed(x: Any, sharding: Any) -> Iterator[None]:
    """While open, `x` (a tracer) is known to be laid out as `sharding` (a
    `NamedSharding`, or `None`: not known): `jit` was given it, as an
    argument's `in_shardings` or a result's `out_shardings`, for the trace that
    `x` belongs to."""
    if sharding is None:
        yield
        return
    before = (_placed.value, _placed.sharding)
    _placed.value, _placed.sharding = x, sharding
    try:
        yield
    finally:
        _placed.value, _placed.sharding = before


def placed_spec(x: Any, mesh: Any) -> Optional[PartitionSpec]:
    """The spec the shardings given to `jit` lay `x` out as (see `placed`), else
    `None`."""
    sharding = _placed.sharding
    if sharding is None or x is not _placed.value:
        return None
    if type(sharding) is not NamedSharding:
        return None
    on = sharding.mesh
    if (on.axis_names, on.axis_sizes) != (mesh.axis_names, mesh.axis_sizes):
        return None
    return sharding.spec


def _producer(x: Any) -> tuple[Any, Any]:
    """The tracer of `jit`'s trace that `x` is, and the equation that produced it
    (`None` if none).

    JAX-private: a `DynamicJaxprTracer` holds it as `parent` (a `TracingEqn`:
    `primitive`, `params`), in JAX 0.8.1
    to 0.12. Under `grad` or `jvp` the value checked is the primal of a JVP or
    linearize tracer, and a constraint constrains the primal. Tracers of other
    traces (`vmap`) have none: their checks wait for the compile.
    """
    for _ in range(8):  # nested `grad`s: one primal inside another
        if isinstance(x, DynamicJaxprTracer) or not hasattr(x, "primal"):
            break
        x = x.primal
    if not isinstance(x, DynamicJaxprTracer):
        return x, None
    eqn = getattr(x, "parent", None)
    if eqn is None or not hasattr(eqn, "params"):
        return x, None
    return x, eqn
