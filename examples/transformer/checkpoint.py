"""The training state through Orbax: saved under one layout, restored onto any.

The restore target is `jts.abstract` of the same initialisation, under the
rules table and mesh of the run that resumes: every array comes back in the
shards that layout asks for (no device reads a whole array), and `check_tree`
verifies it. Nothing here names a mesh axis.
"""

import jax
import orbax.checkpoint as ocp

import jaxtyping_shard as jts

from .layout import RULES
from .model import Config
from .train import init_state, make_mesh, run


def save(directory: str, step: int, state: tuple) -> None:
    """Saves `state` (parameters, optimiser state) as step `step`."""
    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()


def restore(directory: str, config: Config, mesh) -> tuple[int, tuple]:
    """The latest step saved, and its state laid out by the rules in force."""
    key = jax.random.key(0, impl="rbg")  # only shapes are read off it
    target = jts.abstract(init_state, key, config, mesh=mesh)
    with ocp.CheckpointManager(directory) as manager:
        step = manager.latest_step()
        state = manager.restore(step, args=ocp.args.StandardRestore(target))
    params, opt_state = state
    jts.check_tree(params, name="params")
    jts.check_tree(opt_state, like=params, name="opt_state")
    return step, (params, opt_state)


def train_and_resume(
    directory: str,
    before: tuple[str, str, tuple],
    after: tuple[str, str, tuple],
    steps: tuple[int, int] = (2, 2),
    config: Config = Config(),
) -> list[float]:
    """Trains `steps[0]` steps under `before` (layout, mesh kind, mesh shape),
    saves, restores onto `after` and trains `steps[1]` more: the losses of all."""
    first, state = run(*before[:2], steps[0], config, before[2])
    save(directory, steps[0], state)
    layout, kind, shape = after
    mesh = make_mesh(shape, kind)
    with jax.set_mesh(mesh), jts.axis_rules(RULES[layout]):
        step, state = restore(directory, config, mesh)
    assert step == steps[0]
    rest, _ = run(layout, kind, steps[1], config, shape, state=state, first=step)
    return first + rest
