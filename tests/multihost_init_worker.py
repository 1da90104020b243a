"""One process of the two-process job run by `test_multihost_init.py`.

Started by `tests.multihost.run_workers`: joins a job of 2 processes x 4 forced
CPU devices (gloo collectives on loopback, `join_job`) and builds, with
`jts.sharded_init`, a `@jaxtyped` Equinox model whose parameters span both
processes, on an Explicit and on an Auto mesh. Asserts that each process holds
only its own shards, with the right values, and that the result passes its
checks here. Prints `WORKER <id> OK <number of checks>` last and exits 0 if all
held. Not collected by pytest: it needs its own process.
"""

import sys

from tests.multihost import Checks, join_job


def main() -> int:
    process_id, _ = join_job()

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from beartype import beartype
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jaxtyping import Array, jaxtyped

    import jaxtyping_shard as jts
    from jaxtyping_shard import Float

    assert jax.process_count() == 2 and jax.device_count() == 8
    verdict = Checks(process_id)

    @jaxtyped(typechecker=beartype)
    class Dense(eqx.Module):
        weight: Float[Array, "embed mlp", P("data", "model")]
        bias: Float[Array, "mlp", P("model")]  # noqa: F821

    def make(key):
        k1, k2 = jax.random.split(key)
        return Dense(
            jnp.triu(jax.random.normal(k1, (64, 32))), jax.random.uniform(k2, (32,))
        )

    key = jax.random.key(42)
    with jts.set_mode("off"):  # the whole model, on this process's first device
        want = jax.tree.map(np.asarray, make(key))

    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
        model = jts.sharded_init(make, key, mesh=mesh)
        for name, leaf, spec, shard_shape in (
            ("weight", model.weight, P("data", "model"), (16, 16)),
            ("bias", model.bias, P("model"), (16,)),
        ):
            verdict(not leaf.is_fully_addressable, f"{kind} {name} spans processes")
            verdict(
                leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim),
                f"{kind} {name} sharding {leaf.sharding}",
            )
            shards = leaf.addressable_shards
            verdict(len(shards) == 4, f"{kind} {name}: {len(shards)} local shards")
            local = {d.id for d in jax.local_devices()}
            for shard in shards:
                verdict(shard.device.id in local, f"{kind} {name} shard device")
                verdict(
                    shard.data.shape == shard_shape,
                    f"{kind} {name} shard shape {shard.data.shape}",
                )
                expected = getattr(want, name)[shard.index]
                verdict(
                    np.array_equal(np.asarray(shard.data), expected),
                    f"{kind} {name} shard {shard.index} values",
                )
        # The result passes its checks in this process (metadata only).
        with jax.transfer_guard("disallow"):
            for leaf, annotation in (
                (model.weight, Float[Array, "e m", P("data", "model")]),
                (model.bias, Float[Array, "m", P("model")]),  # noqa: F821
            ):
                verdict(isinstance(leaf, annotation), f"{kind} check of the result")
            verdict(
                not isinstance(model.weight, Float[Array, "e m", P("model", "data")]),
                f"{kind} a wrong annotation fails",
            )
        tree = jts.abstract(make, key, mesh=mesh)
        verdict(
            tree.weight.sharding.is_equivalent_to(model.weight.sharding, 2),
            f"{kind} abstract sharding",
        )

    return verdict.done()


if __name__ == "__main__":
    sys.exit(main())
