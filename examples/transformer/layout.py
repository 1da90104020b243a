"""The one rules table: logical names -> mesh axes, per parallelism layout.

The only place in the program where mesh axes are written (besides the mesh
itself). Switching between data parallelism, FSDP and FSDP + tensor
parallelism changes nothing but the table in force.
"""

import jaxtyping_shard as jts


_SAME = {"seq": None, "norm": None}  # never sharded here

RULES = {
    # Pure data parallelism: the batch over every device, parameters replicated.
    "dp": {
        "batch": ("data", "model"),
        "vocab": None,
        "embed": None,
        "heads": None,
        "mlp": None,
        **_SAME,
    },
    # FSDP: the batch over every device, each parameter split over them too
    # (along `embed`) where stored, and gathered where used (`jts.fsdp`).
    "fsdp": {
        "batch": ("data", "model"),
        "embed": jts.fsdp("data", "model"),
        "vocab": None,
        "heads": None,
        "mlp": None,
        **_SAME,
    },
    # FSDP over `data` plus tensor parallelism over `model` (Megatron's split:
    # heads and the MLP's hidden dim column-parallel, their outputs row-parallel).
    "fsdp_tp": {
        "batch": "data",
        "embed": jts.fsdp("data"),
        "vocab": "model",
        "heads": "model",
        "mlp": "model",
        **_SAME,
    },
}
