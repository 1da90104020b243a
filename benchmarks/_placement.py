"""Figure 8: `jts.place` against a hand-written `make_array_from_process_local_data`."""

from typing import Any

import jax
import numpy as np
from _timing import figure, interleaved, Settings  # beside this file
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Int


BATCH = (4096, 4096)  # int32: 64 MiB
Tokens = Int[Array, "batch seq", P("data", None)]


def place_batch(settings: Settings) -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    local = np.arange(np.prod(BATCH), dtype=np.int32).reshape(BATCH)
    sharding = NamedSharding(mesh, P("data", None))  # the spec, written again

    def hand_written() -> Any:
        x = jax.make_array_from_process_local_data(sharding, local)
        return x.block_until_ready()

    def ours() -> Any:
        return jts.place(local, Tokens, mesh).block_until_ready()

    placed, reference = ours(), hand_written()
    live = placed.sharding == reference.sharding and isinstance(placed, Tokens)
    del placed, reference
    times = interleaved({"hand-written": hand_written, "place": ours}, settings)
    return figure(
        "8. place, 64 MiB batch",
        "jts.place(local, Int[Array, 'batch seq', P('data', None)], mesh) (verify "
        "'shapes') / jax.make_array_from_process_local_data(sharding, local), "
        "int32[4096,4096] on 8 CPU devices, one process",
        times["place"],
        times["hand-written"],
        1.05,
        "≤ 1.05",
        live=live,
    )
