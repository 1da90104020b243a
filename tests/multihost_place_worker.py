"""One process of the multi-process placement job run by `test_multihost_place.py`.

Started by `tests.multihost.run_workers`: joins a job of 8 forced CPU devices,
as 2 processes x 4 or 4 x 2 (gloo on loopback, `join_job`), and places a batch
with `jts.place` over `data`, replicated over `model`, on two meshes: one where
`model` stays inside each process (each process loads its own rows) and one
where `model` spans the processes (processes holding the same rows are
replicas). Each process's rows are derived here from the mesh's devices, not by
the library. Asserts the placed arrays equal the single-process reference, that
`jts.jit(in_shardings="annotations")` consumes them, and that the verification
catches unequal replicas and uneven batches on every process alike. Prints
`WORKER <id> OK <number of checks>`. Not collected by pytest.
"""

import functools as ft
import sys

from tests.multihost import Checks, join_job


def main() -> int:
    process_id, _ = join_job()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, PartitionSpec as P
    from jaxtyping import Array

    import jaxtyping_shard as jts
    from jaxtyping_shard import Float, Int

    processes = jax.process_count()
    per_process = jax.local_device_count()
    assert processes * per_process == 8 and per_process >= 2
    verdict = Checks(process_id)

    def expect(error_type, fun, *fragments: str, what: str) -> None:
        try:
            fun()
        except error_type as error:
            text = str(error)
            for fragment in fragments:
                verdict(fragment in text, f"{what}: {fragment!r} not in {text}")
            return
        raise AssertionError(f"process {process_id}: {what}: nothing raised")

    devices = np.array(jax.devices())
    order = [d.process_index for d in devices]
    verdict(order == sorted(order), f"order {devices}")
    explicit = (AxisType.Explicit, AxisType.Explicit)
    # `model` inside each process: each process holds whole rows of the mesh.
    inside = Mesh(devices.reshape(4, 2), ("data", "model"), axis_types=explicit)
    # `model` across processes: column 0 is the first half of the processes,
    # column 1 the second half.
    across = Mesh(devices.reshape(2, 4).T, ("data", "model"), axis_types=explicit)

    def held(mesh, dim: int, size: int) -> slice:
        """The part of a dim of `size` this process holds along mesh dim `dim`,
        from where its devices sit in the mesh (not from the library)."""
        mine = [
            index[dim]
            for index, device in np.ndenumerate(mesh.devices)
            if device.process_index == process_id
        ]
        step = size // mesh.devices.shape[dim]
        return slice(min(mine) * step, (max(mine) + 1) * step)

    Tokens = Int[Array, "batch seq", P("data", None)]
    whole = np.arange(16 * 8, dtype=np.int32).reshape(16, 8)  # the reference
    expected_rows = {"inside": held(inside, 0, 16), "across": held(across, 0, 16)}
    own_rows = expected_rows["inside"].stop - expected_rows["inside"].start

    def same_as_reference(x, reference, what: str) -> None:
        for shard in x.addressable_shards:
            verdict(
                np.array_equal(np.asarray(shard.data), reference[shard.index]),
                f"{what}: shard {shard.index} on {shard.device}",
            )
        gathered = multihost_utils.process_allgather(x, tiled=True)
        verdict(np.array_equal(gathered, reference), f"{what}: gathered")

    def step(
        tokens: Int[Array, "batch seq", P("data", None)],
        w: Float[Array, "seq m", P(None, "model")],
    ) -> Float[Array, "batch m", P("data", "model")]:
        return tokens.astype(jnp.float32) @ w

    for name, mesh in (("inside", inside), ("across", across)):
        rows = jts.local_rows(Tokens, whole.shape, mesh)
        verdict(rows[0] == expected_rows[name], f"{name}: rows {rows}")
        local = whole[rows]
        x = jts.place(local, Tokens, mesh, verify="checksum")
        verdict(x.shape == whole.shape, f"{name}: shape {x.shape}")
        verdict(not x.is_fully_addressable, f"{name}: spans the processes")
        verdict(isinstance(x, Tokens), f"{name}: matches its annotation")
        same_as_reference(x, whole, name)

        # The consumer's annotation is the only place the layout is written.
        y = jts.place_for(step, "tokens", local, mesh)
        verdict(y.sharding.is_equivalent_to(x.sharding, 2), f"{name}: place_for")
        # w's columns are over `model`: across processes each loads one column.
        w_whole = np.arange(16, dtype=np.float32).reshape(8, 2)
        w_rows = jts.local_rows(Float[Array, "s m", P(None, "model")], (8, 2), mesh)
        w_cols = held(mesh, 1, 2)
        verdict(w_rows == (slice(0, 8), w_cols), f"{name}: w rows {w_rows}")
        w = jts.place_for(step, "w", w_whole[w_rows], mesh)
        verdict(w.shape == (8, 2), f"{name}: w {w.shape}")
        same_as_reference(w, w_whole, f"{name} w")

        # A tree: the batch and a replicated scalar table, in one call.
        tree = jts.place(
            {"tokens": local, "scale": np.full((4,), 2.0, np.float32)},
            {"tokens": Tokens, "scale": P()},
            mesh,
            verify="checksum",
        )
        same_as_reference(tree["tokens"], whole, f"{name} tree")

        # jit's shardings from the same signature; results equal the reference.
        jitted = jts.jit(step, in_shardings="annotations", out_shardings="annotations")
        out = jitted(x, w)
        verdict(out.sharding.spec == P("data", "model"), f"{name}: {out.sharding}")
        reference = whole.astype(np.float32) @ w_whole
        same_as_reference(out, reference, f"{name} step")
        wrong = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(None, "data")))
        expect(
            jts.ShardingTypeCheckError,
            ft.partial(jitted, wrong, w),
            "`tokens` is `int32[16,8@data]`",
            what=f"{name}: committed mismatch",
        )

        # A deliberately unequal replica: process 1 loads other data where it
        # should hold what process 0 holds (the whole batch when `model` spans
        # the processes; the replicated table on either mesh).
        if name == "across":
            bad = local + process_id
            # Process 0 and its replica in the other column of the mesh.
            twin = processes // 2
            expect(
                jts.PlacementError,
                ft.partial(jts.place, bad, Tokens, mesh, verify="checksum"),
                f"processes 0, {twin} hold the same part",
                "local data differ",
                what=f"{name}: unequal replicas",
            )
        table = np.full((4,), 2.0 + process_id, np.float32)
        expect(
            jts.PlacementError,
            ft.partial(jts.place, table, P(), mesh, verify="checksum"),
            "replicas",
            what=f"{name}: unequal replicated table",
        )
        # Unchecked, JAX would take the unequal data silently; shapes still match.
        jts.place(table, P(), mesh, verify="shapes")
        verdict(True, f"{name}: shapes-only verification passes")

    # Uneven per-host batches: each process's own size fits the sharding (a
    # multiple of its shards' rows), but the processes disagree; all raise.
    shards = per_process // 2  # of the 4 `data` shards, this process's
    uneven = whole[: 4 * shards if process_id == 0 else 2 * shards]
    expect(
        jts.PlacementError,
        lambda: jts.place(uneven, Tokens, inside),
        "different shapes",
        f"process 0: ({4 * shards}, 8), process 1: ({2 * shards}, 8)",
        what="uneven batches",
    )
    # Caught before anything is built, on each process alone: a local size that
    # is not a multiple of this process's shards (7 rows over 2; with one shard
    # a process, any size fits, and the global shape below catches it).
    if shards > 1:
        expect(
            jts.PlacementError,
            lambda: jts.place(whole[:7], Tokens, inside),
            f"not a multiple of {shards}",
            f"'data' (4) into 4 shards, {shards} of them on this process "
            f"({processes} processes)",
            what="local size",
        )
    expect(
        jts.PlacementError,
        lambda: jts.place(whole[:3], Tokens, inside, global_shape=(16, 8)),
        f"expected {own_rows} or 16",
        what="local size against a global shape",
    )
    # The global shape given: every process passes the whole array.
    full = jts.place(whole, Tokens, inside, global_shape=whole.shape)
    same_as_reference(full, whole, "whole array on every process")

    # A fallback list resolves for the global shape the local data makes, as the
    # check of the result does: 2 rows a process (4 or 8 in all, over `data`), or the
    # same 3 rows on both (replicated: 3 rows do not split over `data`).
    Batch = Int[Array, "batch seq", jts.Logical]
    with jts.axis_rules({"batch": ["data", None], "seq": None}):
        two = jts.place(whole[2 * process_id : 2 * process_id + 2], Batch, inside)
        rows = 2 * processes  # over `data` (4), with 2 or 4 processes
        verdict(two.shape == (rows, 8), f"fallback, 2 rows: {two.shape}")
        verdict(two.sharding.spec[0] == "data", f"fallback, 2 rows: {two.sharding}")
        verdict(isinstance(two, Batch), "fallback, 2 rows: matches its annotation")
        same_as_reference(two, whole[:rows], "fallback, 2 rows")
        # 3 rows a process: 6 do not split over `data` (4), so 2 processes hold
        # the same 3 rows, replicated; 12 do, so 4 processes hold 3 rows each.
        split = (3 * processes) % 4 == 0
        rows = 3 * processes if split else 3
        mine = slice(3 * process_id, 3 * process_id + 3) if split else slice(0, 3)
        three = jts.place(whole[mine], Batch, inside, verify="checksum")
        verdict(three.shape == (rows, 8), f"fallback, 3 rows: {three.shape}")
        verdict(
            three.sharding.spec[0] == "data"
            if split
            else three.sharding.is_fully_replicated,
            f"fallback, 3 rows: {three.sharding}",
        )
        verdict(isinstance(three, Batch), "fallback, 3 rows: matches its annotation")
        same_as_reference(three, whole[:rows], "fallback, 3 rows")

    return verdict.done()


if __name__ == "__main__":
    sys.exit(main())
