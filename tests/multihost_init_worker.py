"""One process of the two-process job run by `test_multihost_init.py`.

Started by `tests.multihost.run_workers`: joins a job of 2 processes x 4 forced
CPU devices (gloo collectives on loopback, `join_job`) and builds, with
`jts.sharded_init`, a `@jaxtyped` Equinox model whose parameters span both
processes, on an Explicit, an Auto and a mixed mesh. Asserts that each process
holds only its own shards (no device a whole parameter), with the right values,
that the result passes `jts.check_tree` here and a deliberately different
annotation fails here, naming the leaf. Prints `WORKER <id> OK <number of
checks>` last and exits 0 if all held. Not collected by pytest.
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

    kinds = {
        "Explicit": (AxisType.Explicit,) * 2,
        "Auto": (AxisType.Auto,) * 2,
        "mixed": (AxisType.Explicit, AxisType.Auto),
    }
    for kind, axis_types in kinds.items():
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=axis_types)
        model = jts.sharded_init(make, key, mesh=mesh)
        # `parts`: into how many parts the processes split the parameter (the
        # bias is replicated over `data`, which spans the processes).
        for name, leaf, spec, shard_shape, parts in (
            ("weight", model.weight, P("data", "model"), (16, 16), 2),
            ("bias", model.bias, P("model"), (16,), 1),
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
                    shard.data.shape == shard_shape and shard.data.size < leaf.size,
                    f"{kind} {name} shard shape {shard.data.shape}: not a whole one",
                )
                expected = getattr(want, name)[shard.index]
                verdict(
                    np.array_equal(np.asarray(shard.data), expected),
                    f"{kind} {name} shard {shard.index} values",
                )
            # This process holds only its own part: the distinct blocks on its
            # devices cover half of the weight, the other process the rest.
            held = np.zeros(leaf.shape, bool)
            for shard in shards:
                held[shard.index] = True
            verdict(held.sum() * parts == leaf.size, f"{kind} {name}: {held.sum()}")
        # The result passes `check_tree` in this process (metadata only), and
        # a deliberately different annotation fails here, naming the leaf.
        with jax.transfer_guard("disallow"):
            verdict(jts.check_tree(model, name="model") is model, f"{kind} check")
            wrong = {"weight": P("model", "data"), "bias": P("model")}
            text = verdict.raises(
                jts.ShardingTypeCheckError,
                jts.check_tree,
                model,
                wrong,
                what=f"{kind} check_tree against another annotation",
            )
            for fragment in (
                "check_tree(tree): 1 of 2",
                "tree.weight: this array is sharded as `float32[64@data,32@model]`",
                "P('model', 'data')",
            ):
                verdict(fragment in text, f"{kind}: {fragment!r} not in {text}")
        # An argument that is itself a global array (spanning both processes)
        # is used where it lies: no process holds all of it to copy. Global
        # [2, 2, 3, 3]: the weights come out scaled by 10.
        scale = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), np.full((2,), 2.0 + process_id, np.float32)
        )
        verdict(not scale.is_fully_addressable, f"{kind} scale spans processes")

        def scaled(key, scale):
            dense = make(key)
            return Dense(dense.weight * scale.sum(), dense.bias)

        model2 = jts.sharded_init(scaled, key, scale, mesh=mesh)
        verdict(jts.check_tree(model2) is model2, f"{kind} check of a scaled init")
        for shard, shard2 in zip(
            model.weight.addressable_shards, model2.weight.addressable_shards
        ):
            verdict(
                np.allclose(np.asarray(shard2.data), 10.0 * np.asarray(shard.data)),
                f"{kind} scaled shard {shard.index}",
            )
        tree = jts.abstract(make, key, mesh=mesh)
        verdict(
            tree.weight.sharding.is_equivalent_to(model.weight.sharding, 2),
            f"{kind} abstract sharding",
        )
        rows = {row.path: row for row in jts.explain(model, mesh).rows}
        verdict(
            rows[".weight"].shard_shape == (16, 16)
            and rows[".bias"].shard_shape == (16,),
            f"{kind} explain {rows}",
        )

    return verdict.done()


if __name__ == "__main__":
    sys.exit(main())
