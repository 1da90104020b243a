"""The layouts `jts.reshard` constrained values to on Auto axes, by tracer.

`reshard` (a driver) records each constrained value here; the verdict reads it
(`constrained_spec`) to decide a check of that very value at trace time. Kept
in the verdict so that the verdict imports no driver.
"""

import threading
import weakref
from typing import Any, Optional

from jax.sharding import PartitionSpec


# The Auto-axes layout each `reshard` output is constrained to, by tracer: XLA
# must honour a constraint, so a check of that very value is decided at trace
# time (see `check`). Without this, XLA propagates the constrained layout
# backwards too, and the compile-time report lists values upstream of the
# constraint (its victims) before the constrained value (the culprit).
_constrained: dict = {}
_lock = threading.Lock()


def remember(x: Any, spec: PartitionSpec) -> None:
    key = id(x)

    def forget(_: Any) -> None:
        with _lock:
            if _constrained.get(key, (None,))[0] is ref:
                del _constrained[key]

    try:
        ref = weakref.ref(x, forget)
    except TypeError:  # pragma: no cover - a tracer type without weak references
        return
    with _lock:
        _constrained[key] = (ref, spec)


def constrained_spec(x: Any) -> Optional[PartitionSpec]:
    """The spec `x` was constrained to by `reshard` on Auto axes, else `None`."""
    entry = _constrained.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]
