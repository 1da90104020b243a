"""One process of `benchmarks/multihost.py`'s job (8 processes x 8 CPU devices by
default): times `check_tree`, `place` and `sharded_init` on a mesh spanning every
process, and verifies each process's `place` input and result as the tests do.

Run by the launcher, as `python multihost_worker.py ADDRESS ID COUNT`; prints one
line `TIMES <json>` and `WORKER <id> OK <checks>`. Not collected by pytest.
"""

import json
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.multihost import Checks, join_job  # noqa: E402


def main() -> int:
    process_id, _ = join_job()

    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, PartitionSpec as P
    from jaxtyping import Array

    import jaxtyping_shard as jts
    from jaxtyping_shard import Float, Int

    verdict = Checks(process_id)
    devices = np.array(jax.devices())
    count = len(devices)
    model = 4 if count % 4 == 0 else 1
    mesh = Mesh(
        devices.reshape(count // model, model),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    data = mesh.devices.shape[0]

    def timing(fn, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    # sharded_init: a stack of annotated layers, every parameter in its shards.
    Bias = Float[Array, "mlp", P("model")]

    class Layer(eqx.Module):
        w: Float[Array, "embed mlp", P("data", "model")]
        b: Bias

        def __init__(self, key):
            self.w = jax.random.normal(key, (64 * data, 32 * model))
            self.b = jax.numpy.zeros(32 * model)

    def make(key):
        return [Layer(k) for k in jax.random.split(key, 8)]

    key = jax.random.key(0)
    start = time.perf_counter()
    params = jts.sharded_init(make, key, mesh=mesh)
    init_s = time.perf_counter() - start
    for layer in params:
        verdict(not layer.w.is_fully_addressable, "a weight spans the processes")
        verdict(
            all(s.data.shape == (64, 32) for s in layer.w.addressable_shards),
            "each device holds one shard of each weight",
        )
    check_s = timing(lambda: jts.check_tree(params))

    # place: each process's rows, derived from the mesh here, and the result's
    # shards compared with the single-process reference.
    Tokens = Int[Array, "batch seq", P("data", None)]
    whole = np.arange(16 * data * 128, dtype=np.int32).reshape(16 * data, 128)
    mine = [
        i for (i, _), d in np.ndenumerate(mesh.devices) if d.process_index == process_id
    ]
    rows = slice(min(mine) * 16, (max(mine) + 1) * 16)
    verdict(jts.local_rows(Tokens, whole.shape, mesh)[0] == rows, f"rows {rows}")
    local = whole[rows]
    batch = jts.place(local, Tokens, mesh)
    verdict(batch.shape == whole.shape, f"global shape {batch.shape}")
    for shard in batch.addressable_shards:
        verdict(
            np.array_equal(np.asarray(shard.data), whole[shard.index]),
            f"shard {shard.index} equals the reference",
        )
    place_s = timing(lambda: jts.place(local, Tokens, mesh))
    checksum_s = timing(lambda: jts.place(local, Tokens, mesh, verify="checksum"))

    times = {
        "process": process_id,
        "processes": jax.process_count(),
        "devices": count,
        "sharded_init_s": init_s,
        "check_tree_s": check_s,
        "leaves": len(jax.tree_util.tree_leaves(params)),
        "place_s": place_s,
        "place_checksum_s": checksum_s,
        "local_batch_bytes": local.nbytes,
    }
    print("TIMES " + json.dumps(times), flush=True)
    return verdict.done()


if __name__ == "__main__":
    sys.exit(main())
