"""One scoped lowering choice: threefry unrolled on CPU, as on GPU and TPU.

JAX lowers the `threefry2x32` primitive (the default PRNG) with a rolled
`fori_loop` on CPU only (`jax/_src/random/threefry2x32.py`,
`_threefry2x32_cpu_lowering_rule`, to keep CPU compiles small); GPU and TPU use
the unrolled lowering. The rolled loop keeps two `uint32` state arrays of every
shard alive across iterations: for a 64 MiB weight on 8 devices that is 24 MiB of
temporaries per device (3x the 8 MiB shard), against ~0 with the unrolled one.
Both lowerings compute the same bits (tested), so `sharded_init` lowers with the
unrolled rule to meet its memory bound on CPU too.

No public API chooses a primitive's lowering, so this swaps JAX's private rule
table for the duration of one lowering, under a lock. Another thread lowering at
the same moment may get the unrolled rule as well: the same numbers, a larger
program. Any failure to find the internals leaves JAX's rule alone
(`available()` is then `False`, and the memory bound holds on GPU and TPU only).
"""

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

from ..._core import compat as _compat


_lock = threading.Lock()


def _internals() -> Any:
    try:
        from jax._src.interpreters import mlir  # JAX-private, read only when used

        threefry = _compat.threefry_module()
        table = mlir._platform_specific_lowerings["cpu"]
        entry = mlir.LoweringRuleEntry(threefry._threefry2x32_lowering_rule, False)
        return table, threefry.threefry2x32_p, entry
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX
        return None


def available() -> bool:
    """Whether the unrolled CPU lowering can be chosen with this JAX."""
    return _internals() is not None


@contextlib.contextmanager
def unrolled_threefry_on_cpu() -> Iterator[None]:
    """Within this block, `threefry2x32` lowers unrolled on CPU too."""
    found = _internals()
    if found is None:  # pragma: no cover - other JAX
        yield
        return
    table, primitive, entry = found
    with _lock:
        saved = table.get(primitive)
        table[primitive] = _by_size(entry, saved) if saved is not None else entry
        try:
            yield
        finally:
            if saved is None:  # pragma: no cover - JAX always registers one
                table.pop(primitive, None)
            else:
                table[primitive] = saved


# Below this many 32-bit words a threefry call keeps JAX's CPU rule: a rolled loop
# over a small array costs little memory, and XLA on JAX 0.12 takes minutes (or
# never ends) compiling the unrolled rounds of many small calls (an `eqx.nn.MLP`'s
# initialisers, say). The large draws the memory bound is about are unrolled.
UNROLL_FROM = 1 << 16


def _by_size(unrolled: Any, rolled: Any) -> Any:
    """A lowering entry that picks the unrolled rule for large draws only."""

    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        size = max((math.prod(a.shape) for a in ctx.avals_in), default=0)
        chosen = unrolled if size >= UNROLL_FROM else rolled
        return chosen.rule(ctx, *args, **params)

    return type(unrolled)(rule, unrolled.inline)
