"""`python -m jaxtyping_shard.demo`: a correct call and caught mis-shardings.

The first failure is printed whole, as Python prints it for an uncaught error;
the others are excerpts. Runs on 8 forced CPU devices; no accelerator needed.
"""

import os
import traceback


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxtyping  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard import Float  # noqa: E402


@jts.jaxtyped(typechecker=beartype)
def layer(
    x: Float[Array, "batch embed", P("data", None)],
    w: Float[Array, "embed mlp", P(None, "model")],
) -> Float[Array, "batch mlp", P("data", "model")]:
    return x @ w


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


def main() -> int:
    devices = jax.devices()
    print(f"JAX {jax.__version__}, {len(devices)} devices: {devices[0].platform}")
    # Axis types explicit: jax.make_mesh's default changed in 0.9 (Auto before).
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", None)))
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "model")))

    print("\n1. A correct call (Explicit mesh, eager and inside jit):")
    print("   layer(x, w) ->", jax.typeof(layer(x, w)))
    print("   jit(layer)(x, w) ->", jax.typeof(jax.jit(layer)(x, w)))

    print("\n2. x sharded over 'model' instead of 'data', eager. What Python prints:\n")
    x_bad = jax.device_put(x, NamedSharding(mesh, P("model", None)))
    try:
        layer(x_bad, w)
    except jaxtyping.TypeCheckError as error:
        print("".join(traceback.format_exception_only(type(error), error)))
    else:
        print("   NOT CAUGHT")
        return 1

    print("3. The same inside jit: caught at trace time, before anything runs:")
    try:
        jax.jit(layer).trace(x_bad, w)
    except jaxtyping.TypeCheckError as error:
        print("   caught:", _first_line(error))
    else:
        print("   NOT CAUGHT")
        return 1

    print("\n4. Auto mesh axes: XLA picks the sharding; checked when it compiles:")
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    xa = jax.device_put(jnp.ones((8, 16)), NamedSharding(auto, P("model", None)))
    wa = jax.device_put(jnp.ones((16, 32)), NamedSharding(auto, P(None, "model")))
    try:
        jts.jit(layer)(xa, wa)
    except jts.ShardingTypeCheckError as error:
        print("   caught:", str(error).replace("\n", "\n   "))
    else:
        print("   NOT CAUGHT")
        return 1
    print("\nAll sharding mistakes were caught.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
