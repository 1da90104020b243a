"""What `jts.preflight(..., check_mesh="cpu")` costs: wall time of the whole
preflight (its trace on the AbstractMesh, the child process started, the step
compiled there on forced CPU devices, the answer read back), the child's CPU
seconds and its peak resident memory, at 256, 1,024 and 2,048 devices, for a
small Auto step.

    python benchmarks/cpu_mesh.py [--sizes 256,1024,2048]

The step is defined in this script, so the child imports the script as
`__mp_main__` (its code below sits under `if __name__ == "__main__":`).
"""

import argparse
import resource
import time

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float


W = Float[Array, "e m@model"]
X = Float[Array, "b@data e"]


def step(w: W, x: X) -> X:
    h = jnp.tanh(x @ w)
    return h @ w.T


SHAPES = {256: (32, 8), 1024: (128, 8), 2048: (256, 8)}


def measure(devices: int) -> dict:
    mesh = AbstractMesh(SHAPES[devices], ("data", "model"), (AxisType.Auto,) * 2)
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    report = jts.preflight(step, w, x, mesh=mesh, check_mesh="cpu")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = after.ru_maxrss * 1024
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "devices": devices,
        "wall_s": round(wall, 2),
        "child_cpu_s": round(cpu, 2),
        "child_peak_rss_mib": round(children / 2**20),
        "temporary_bytes": report.temporary_bytes,
        "collectives": report.collectives.count,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="256,1024,2048")
    sizes = [int(s) for s in parser.parse_args().sizes.split(",")]
    for n in sorted(sizes):  # ascending: the children's peak so far is this one's
        print(measure(n), flush=True)
    parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print({"parent_peak_rss_mib": round(parent)})
