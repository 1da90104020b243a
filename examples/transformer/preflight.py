"""The training step checked on a pod-sized mesh, and its memory counted, here.

`python -m examples.transformer.preflight` traces `train_step` on a 4,096-device
`AbstractMesh` (512 x 8) at a production-sized config, with its inputs made by
the program's own `init` and `load_batch`, abstractly (under `jax.eval_shape`:
nothing is created), and prints `jts.preflight`'s report. No device is used.

- `--mesh 512x8`, `--axes explicit|auto`, `--layers N`, `--layout fsdp_tp|fsdp|dp`,
  `--hbm-gib G` (a budget per device), `--check-mesh cpu` (the step also
  compiled on forced CPU devices in a child process, the mesh folded beyond
  2,048 devices: its temporaries counted in the budget), `--remat POLICY|none`
  (`POD.remat` by default).
"""

import argparse
import dataclasses
import sys

import jax
from jax.sharding import AbstractMesh, AxisType

import jaxtyping_shard as jts

from .layout import RULES
from .model import Config
from .train import init, load_batch, train_step


# A production-sized model: about 7 B parameters at 32 layers.
POD = Config(
    vocab=32768,
    embed=4096,
    heads=32,
    head_dim=128,
    mlp=16384,
    layers=32,
    seq=2048,
    batch=1024,  # 2 rows per `data` device: one per micro-batch
    # Each layer's matmul outputs kept for the backward pass, the rest (the
    # attention scores and weights, the norms, the activations) recomputed:
    # without it the temporaries alone are 35 GiB per device (see README).
    remat="dots_with_no_batch_dims_saveable",
)


def make_mesh(shape=(512, 8), axis_type: str = "explicit") -> AbstractMesh:
    """The production mesh, abstract: `train.make_mesh`'s axes, no devices."""
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
    return AbstractMesh(tuple(shape), ("data", "model"), axis_types=(kind,) * 2)


def abstract_inputs(config: Config, mesh: AbstractMesh, layout: str = "fsdp_tp"):
    """`(params, opt, batch)` as `init` and `load_batch` make them on `mesh`, as
    `jax.ShapeDtypeStruct`s with their shardings: traced, never run."""
    with jts.axis_rules(RULES[layout]), jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(
            lambda: (*init(config, mesh), load_batch(0, config, mesh))
        )


def preflight(
    config: Config = POD, mesh=None, layout: str = "fsdp_tp", **options
) -> jts.PreflightReport:
    """`jts.preflight` of `train_step` on `mesh` (default: 512 x 8, Explicit)."""
    mesh = make_mesh() if mesh is None else mesh
    params, opt, batch = abstract_inputs(config, mesh, layout)
    with jts.axis_rules(RULES[layout]):
        return jts.preflight(train_step, params, opt, batch, mesh=mesh, **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.transformer.preflight")
    parser.add_argument("--mesh", default="512x8")
    parser.add_argument("--axes", default="explicit", choices=["explicit", "auto"])
    parser.add_argument("--layers", type=int, default=POD.layers)
    parser.add_argument("--layout", default="fsdp_tp", choices=sorted(RULES))
    parser.add_argument("--hbm-gib", type=float, default=None)
    parser.add_argument("--check-mesh", default=None, choices=["cpu"])
    parser.add_argument("--remat", default=POD.remat)
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.mesh.split("x"))
    remat = None if args.remat == "none" else args.remat
    config = dataclasses.replace(POD, layers=args.layers, remat=remat)
    hbm = None if args.hbm_gib is None else int(args.hbm_gib * 2**30)
    options = {"hbm_bytes": hbm, "check_mesh": args.check_mesh}
    report = preflight(config, make_mesh(shape, args.axes), args.layout, **options)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
