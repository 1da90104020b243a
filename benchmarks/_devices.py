"""The CPU device count the figures need, set before JAX is imported (no JAX here:
`run.py` and `_eager.py`'s child processes call it first)."""

import os


DEVICE_COUNT = 8


def force_cpu_devices(count: int = DEVICE_COUNT) -> None:
    """Asks XLA for `count` CPU devices, unless `XLA_FLAGS` already sets a count.

    Must run before JAX is imported; appends, as JAX's own test utilities do, so
    other flags the user set are kept.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
