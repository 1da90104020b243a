"""One process of the multi-process job run by `test_multihost_init.py`.

Started by `tests.multihost.run_workers`: joins a job of 8 forced CPU devices,
as 2 processes x 4 or 4 x 2 (gloo collectives on loopback, `join_job`), and
builds, with `jts.sharded_init`, a `@jaxtyped` Equinox model whose parameters
span the processes, on an Explicit, an Auto and a mixed mesh. Asserts that each process
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

    processes = jax.process_count()
    assert jax.device_count() == 8 and processes in (2, 4)
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
        # Where this process's devices sit in the mesh: the (data, model) blocks
        # of the weight it holds, and the model blocks of the bias (replicated
        # over `data`, which spans the processes).
        mine = [
            index
            for index, device in np.ndenumerate(mesh.devices)
            if device.process_index == process_id
        ]
        blocks = {"weight": len(set(mine)), "bias": len({j for _, j in mine})}
        for name, leaf, spec, shard_shape, count in (
            ("weight", model.weight, P("data", "model"), (16, 16), 8),
            ("bias", model.bias, P("model"), (16,), 2),
        ):
            verdict(not leaf.is_fully_addressable, f"{kind} {name} spans processes")
            verdict(
                leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim),
                f"{kind} {name} sharding {leaf.sharding}",
            )
            shards = leaf.addressable_shards
            verdict(
                len(shards) == jax.local_device_count(),
                f"{kind} {name}: {len(shards)} local shards",
            )
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
            # devices, of the `count` the parameter is cut into.
            held = np.zeros(leaf.shape, bool)
            for shard in shards:
                held[shard.index] = True
            verdict(
                held.sum() * count == leaf.size * blocks[name],
                f"{kind} {name}: {held.sum()}",
            )
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
        # An argument that is itself a global array (spanning the processes)
        # is used where it lies: no process holds all of it to copy. Each
        # process gives its `data` rows the value 2 + its index: the weights
        # come out scaled by their sum (10 on 2 processes, 14 on 4).
        rows = len({i for i, _ in mine})
        verdict(rows * processes == 4, f"{kind}: processes hold disjoint data rows")
        scale = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")),
            np.full((rows,), 2.0 + process_id, np.float32),
        )
        verdict(not scale.is_fully_addressable, f"{kind} scale spans processes")
        total = sum(2.0 + p for p in range(processes)) * (4 // processes)

        def scaled(key, scale):
            dense = make(key)
            return Dense(dense.weight * scale.sum(), dense.bias)

        model2 = jts.sharded_init(scaled, key, scale, mesh=mesh)
        verdict(jts.check_tree(model2) is model2, f"{kind} check of a scaled init")
        for shard, shard2 in zip(
            model.weight.addressable_shards, model2.weight.addressable_shards
        ):
            verdict(
                np.allclose(np.asarray(shard2.data), total * np.asarray(shard.data)),
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
