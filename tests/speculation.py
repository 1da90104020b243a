"""What the `jts.jit` speculation tests share: a small annotated model, its
arguments on a mesh, and a counter of the calls that went the ordinary way."""

import equinox as eqx
import numpy as np
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import place


X = Float[Array, "b e", P("data", None)]
W = Float[Array, "e m", P(None, "model")]
Y = Float[Array, "b m", P("data", "model")]
LOGICAL = Float[Array, "batch embed", jts.Logical]


class Linear(eqx.Module):
    w: W
    b: Float[Array, "m"]  # noqa: F821


@jaxtyped(typechecker=beartype)
def apply(m: Linear, x: X) -> Y:
    return x @ m.w + m.b


def args_on(mesh, batch=8):
    m = Linear(place(mesh, (4, 2), P(None, "model")), place(mesh, (2,), P()))
    return m, place(mesh, (batch, 4), P("data", None))


def want(m, x):
    return np.asarray(x) @ np.asarray(m.w) + np.asarray(m.b)


class Ordinary:
    """Counts the calls that went the ordinary way (derived here, not speculated)."""

    def __init__(self, f, monkeypatch):
        self.count = 0
        prepare = f._prepare

        def counted(*args, **kwargs):
            self.count += 1
            return prepare(*args, **kwargs)

        monkeypatch.setattr(f, "_prepare", counted)


def annotated_jit(fun, **kwargs):
    return jts.jit(
        fun, in_shardings="annotations", out_shardings="annotations", **kwargs
    )
