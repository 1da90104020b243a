"""The one rules table: logical names -> mesh axes, per parallelism layout.

The only place in the program where mesh axes are written (besides the mesh
itself). Switching between data parallelism, FSDP and FSDP + tensor
parallelism changes nothing but the table in force.
"""

_SAME = {"seq": None, "norm": None, "act_embed": None}  # never sharded here

RULES = {
    # Pure data parallelism: the batch over every device, parameters replicated.
    "dp": {
        "batch": ("data", "model"),
        "vocab": None,
        "embed": None,
        "heads": None,
        "mlp": None,
        "act_heads": None,
        "act_mlp": None,
        "act_vocab": None,
        **_SAME,
    },
    # FSDP: the batch over every device, each parameter split over them too
    # (along `embed`) and gathered for its matmul.
    "fsdp": {
        "batch": ("data", "model"),
        "embed": ("data", "model"),
        "vocab": None,
        "heads": None,
        "mlp": None,
        "act_heads": None,
        "act_mlp": None,
        "act_vocab": None,
        **_SAME,
    },
    # FSDP over `data` plus tensor parallelism over `model` (Megatron's split:
    # heads and the MLP's hidden dim column-parallel, their outputs row-parallel).
    "fsdp_tp": {
        "batch": "data",
        "embed": "data",
        "vocab": "model",
        "heads": "model",
        "mlp": "model",
        "act_heads": "model",
        "act_mlp": "model",
        "act_vocab": "model",
        **_SAME,
    },
}
