"""`python -m examples.transformer`: train on a 4x2 mesh, check the loss.

Trains FSDP + tensor parallelism on an Explicit and an Auto mesh (8 CPU
devices), and the same program on one device, and checks the losses agree.

- `--layout dp|fsdp|fsdp_tp|all`: which rules table(s) (default `fsdp_tp`).
- `--processes 2`: the same on 2 processes x 4 CPU devices (gloo on loopback),
  started by this command; each process checks its losses against a run on one
  of its own devices.

Then it saves an Orbax checkpoint as FSDP on the 4x2 mesh of one kind and
resumes from it as FSDP + TP on the mesh of the other kind: the losses of the
run with a restart in it equal those of one device.
"""

import argparse
import os
import sys


_FLAG = "--xla_force_host_platform_device_count"


def _force_devices(count: int) -> None:
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}={count}"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.transformer")
    parser.add_argument(
        "--layout", default="fsdp_tp", choices=["dp", "fsdp", "fsdp_tp", "all"]
    )
    parser.add_argument("--mesh", default="both", choices=["explicit", "auto", "both"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.processes > 1 and args.worker is None:
        from .launch import launch

        return launch(args.processes, [*_passed(args), "--steps", str(args.steps)])

    if args.worker is None and _FLAG not in os.environ.get("XLA_FLAGS", ""):
        _force_devices(8)
    import jax

    if args.worker is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            num_processes=args.processes,
            process_id=args.worker,
            initialization_timeout=60,
            heartbeat_timeout_seconds=30,
            shutdown_timeout_seconds=30,
        )
    from .collectives import baseline, report
    from .train import train

    layouts = ["dp", "fsdp", "fsdp_tp"] if args.layout == "all" else [args.layout]
    kinds = ["explicit", "auto"] if args.mesh == "both" else [args.mesh]
    # The same program on one device (every rule trivially satisfied): the math.
    one_device = jax.local_devices()[:1]
    reference = train(
        layouts[0], "explicit", args.steps, mesh_shape=(1, 1), devices=one_device
    )
    for layout in layouts:
        for kind in kinds:
            losses = train(layout, kind, args.steps)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert worst < 1e-5, (layout, kind, losses, reference)
            who = "" if args.worker is None else f"process {args.worker}: "
            shown = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
            print(
                f"{who}{layout} on a {kind} 4x2 mesh ({jax.process_count()} "
                f"process(es)): losses {shown(losses)}; one device: "
                f"{shown(reference)} (worst relative difference {worst:.1e})",
                flush=True,
            )
            if layout == "fsdp_tp":
                # The step just compiled: the report compiles nothing again.
                found = report(kind)
                found.check(baseline(kind))
                print(
                    f"{who}collectives of the {layout} step on the {kind} mesh as in "
                    f"{baseline(kind).name}: {found.count} per call",
                    flush=True,
                )
    _resume(args, kinds, reference)
    if args.worker is not None:
        print(f"WORKER {args.worker} OK", flush=True)
        jax.distributed.shutdown()
    return 0


def _resume(args, kinds: list[str], reference: list[float]) -> None:
    """Trains, saves with Orbax, restores onto another layout, trains on."""
    import tempfile

    import jax

    from .checkpoint import train_and_resume

    who = "" if args.worker is None else f"process {args.worker}: "
    with tempfile.TemporaryDirectory() as scratch:
        for before, after in zip(kinds, reversed(kinds)):
            # One directory for every process of the job (the launcher's).
            root = args.checkpoint or scratch
            directory = os.path.join(root, f"{before}-to-{after}")
            losses = train_and_resume(
                directory,
                ("fsdp", before, (4, 2)),
                ("fsdp_tp", after, (4, 2)),
                (args.steps - 1, 1),
            )
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert worst < 1e-5, (before, after, losses, reference)
            print(
                f"{who}resumed from an Orbax checkpoint of fsdp on a {before} 4x2 "
                f"mesh as fsdp_tp on a {after} 4x2 mesh ({jax.process_count()} "
                f"process(es)): worst relative difference {worst:.1e}",
                flush=True,
            )


def _passed(args) -> list[str]:
    return ["--layout", args.layout, "--mesh", args.mesh]


if __name__ == "__main__":
    sys.exit(main())
