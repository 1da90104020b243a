"""The training step's collectives, held to the baseline saved next to it.

`python -m examples.transformer.collectives` prints the table of the FSDP + TP
step's collectives (4x2 mesh, default config) and checks it against
`collectives.json` (`--mesh auto`: `collectives_auto.json`); `--update`
rewrites this JAX release's section of that file (the one command to run after
a change to the program that is meant to change its collectives; run it under
each JAX release the tests run on, for each mesh). The step is compiled for
abstract arguments: nothing is initialised or run.

The two meshes have a baseline each: on the `Explicit` mesh the step
accumulates its gradients unreduced over `data` (one reduction per step, after
the micro-batch scan), on the `Auto` mesh it reduces each micro-batch's
(`train.accumulate`): JAX has `unreduced` values only on `Explicit` axes.
"""

import argparse
import os
import sys
from pathlib import Path


BASELINE = Path(__file__).with_name("collectives.json")  # the Explicit mesh
AUTO_BASELINE = Path(__file__).with_name("collectives_auto.json")


def baseline(axis_type: str = "explicit") -> Path:
    """The baseline of the step on a mesh of this kind."""
    return AUTO_BASELINE if axis_type == "auto" else BASELINE


def arguments(config, mesh):
    """`train_step`'s arguments as `jax.ShapeDtypeStruct`s laid out as annotated
    (under the rules table in force)."""
    import jax
    import numpy as np

    import jaxtyping_shard as jts

    from . import train

    key = jax.random.key(0, impl="rbg")
    params, opt = jts.abstract(train.init_state, key, config, mesh=mesh)
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq), np.int32)
    shapes = train.Batch(tokens, tokens)
    batch = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        jts.shardings(shapes, mesh),
    )
    return params, opt, batch


def report(axis_type: str = "explicit", config=None, mesh_shape=(4, 2)):
    """The collectives of `train_step` under the FSDP + TP rules table."""
    import jax

    import jaxtyping_shard as jts

    from . import train
    from .layout import RULES
    from .model import Config

    config = Config() if config is None else config
    mesh = train.make_mesh(mesh_shape, axis_type)
    with jax.set_mesh(mesh), jts.axis_rules(RULES["fsdp_tp"]):
        return jts.collectives(train.train_step, *arguments(config, mesh))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.transformer.collectives")
    parser.add_argument("--mesh", default="explicit", choices=["explicit", "auto"])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline")
    args = parser.parse_args(argv)
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}=8"
    found = report(args.mesh)
    print(found)
    found.check(baseline(args.mesh), update=args.update)
    print(f"{'wrote' if args.update else 'as in'} {baseline(args.mesh).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
