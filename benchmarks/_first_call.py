"""Figure 7: the first call (trace + compile + run) of a small MLP training step.

`jaxtyping_shard.jit` of the step with sharded annotations, against `jax.jit` of
the same step with plain jaxtyping annotations, JAX's caches cleared before each
call, on an Explicit mesh (checked while tracing) and an Auto mesh (checked while
XLA compiles).
"""

from typing import Any

import jax
import jax.numpy as jnp
from _timing import figure, one_shots, Settings, timed
from beartype import beartype
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float as PlainFloat, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float


BATCH, EMBED, HIDDEN = 64, 32, 128


def _step(sharded: bool) -> Any:
    """A fresh training step (a new function each time: no cache can hold it)."""

    def ann(dims: str, spec: Any) -> Any:
        return Float[Array, dims, spec] if sharded else PlainFloat[Array, dims]

    W = ann("e h", P())
    V = ann("h e", P())
    X = ann("b e", P("data", None))

    @jaxtyped(typechecker=beartype)
    def layer(w: W, v: V, x: X) -> X:
        return jnp.tanh(x @ w) @ v

    def loss(params, x, y):
        w, v = params
        return jnp.mean((layer(w, v, x) - y) ** 2)

    def step(w, v, x, y):
        value, (gw, gv) = jax.value_and_grad(loss)((w, v), x, y)
        return w - 0.1 * gw, v - 0.1 * gv, value

    return jts.jit(step) if sharded else jax.jit(step)


def _inputs(kind: str) -> tuple:
    axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)

    def put(shape: tuple, spec: Any, seed: int) -> Any:
        x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return (
        put((EMBED, HIDDEN), P(), 0),
        put((HIDDEN, EMBED), P(), 1),
        put((BATCH, EMBED), P("data", None), 2),
        put((BATCH, EMBED), P("data", None), 3),
    )


def _wrong(kind: str) -> bool:
    """The check is live: a mis-sharded batch fails."""
    w, v, x, y = _inputs(kind)
    bad = jax.device_put(x, NamedSharding(x.sharding.mesh, P("model", None)))
    try:
        _step(sharded=True)(w, v, bad, y)
    except jax.errors.JaxRuntimeError:
        return False
    except Exception:
        return True
    return False


def first_call(settings: Settings) -> list[dict]:
    figures = []
    for kind, target, target_text in (
        ("explicit", 1.10, "≤ 1.10"),
        ("auto", None, "report"),
    ):
        args = _inputs(kind)

        def run(sharded: bool, args: tuple = args) -> float:
            return timed(lambda: jax.block_until_ready(_step(sharded)(*args)))

        # A first call takes seconds: one pair per kind in --smoke.
        repeats = 1 if settings.smoke else settings.one_shot_repeats
        times = one_shots(
            {"plain": lambda: run(False), "ours": lambda: run(True)}, repeats
        )
        figures.append(
            figure(
                f"7. first call, MLP step, {kind.capitalize()}",
                "trace + compile + run of jaxtyping_shard.jit(step), sharded "
                "annotations / jax.jit(step), plain jaxtyping annotations; caches "
                f"cleared; {kind.capitalize()} mesh",
                times["ours"],
                times["plain"],
                target,
                target_text,
                live=_wrong(kind),
            )
        )
    return figures
