"""A tensor-parallel MLP in shard_map, its specs read from its annotations.

Column-parallel first matmul (w1 split over `model` by columns), row-parallel
second matmul (w2 split over `model` by rows), then a `psum` over `model`. Every
annotation describes the *global* array; inside the body each value is a local
shard and is checked as such. Run: `python examples/tp_mlp.py` (8 CPU devices).
"""

import os


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jaxtyping  # noqa: E402
import numpy as np  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, jaxtyped  # noqa: E402

from jaxtyping_shard import Float, typed_shard_map  # noqa: E402


Tokens = Float[Array, "batch@data embed"]
W1 = Float[Array, "embed hidden@model"]  # column-parallel
W2 = Float[Array, "hidden@model embed"]  # row-parallel
Hidden = Float[Array, "batch@data hidden@model"]


@jaxtyped(typechecker=beartype)
def column(x: Tokens, w1: W1) -> Hidden:
    return jax.nn.relu(x @ w1)


@jaxtyped(typechecker=beartype)
def row(h: Hidden, w2: W2) -> Tokens:
    partial = h @ w2  # each model shard holds a partial sum over its hidden slice
    return jax.lax.psum(partial, "model")


def make_mlp(mesh, forget_psum: bool = False):
    @typed_shard_map(mesh=mesh)
    @jaxtyped(typechecker=beartype)
    def mlp(x: Tokens, w1: W1, w2: W2) -> Tokens:
        h = column(x, w1)
        if forget_psum:
            return h @ w2  # still varies over `model`: not what Tokens says
        return row(h, w2)

    return mlp


def main() -> int:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(key1, (16, 8)), NamedSharding(mesh, P("data")))
    w1 = jax.device_put(
        jax.random.normal(key2, (8, 32)), NamedSharding(mesh, P(None, "model"))
    )
    w2 = jax.device_put(
        jax.random.normal(key3, (32, 8)), NamedSharding(mesh, P("model"))
    )

    y = jax.jit(make_mlp(mesh))(x, w1, w2)
    xs, w1s, w2s = (np.asarray(a) for a in (x, w1, w2))
    reference = np.maximum(xs @ w1s, 0) @ w2s
    assert np.allclose(np.asarray(y), reference, atol=1e-4), "wrong result"
    print("tensor-parallel MLP:", jax.typeof(y), "matches the unsharded result")

    try:
        jax.jit(make_mlp(mesh, forget_psum=True))(x, w1, w2)
    except jaxtyping.TypeCheckError as error:
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        reason = str(cause)
        print(
            "forgetting the psum is caught:",
            reason[reason.find("this local") :][:150],
            "...",
        )
    else:
        print("forgetting the psum was NOT caught")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
