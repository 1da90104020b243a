"""Which part of a global array each process holds, read off a `NamedSharding`.

The arithmetic behind `place` and `local_rows`, and nothing else: for a sharding
and a rank, how many shards each dim is cut into, which of them every process
holds, and from that the global shape of a local block (and the reverse). Every
process computes the same answer for every other process from the mesh alone, so
no data moves.
"""

import functools as ft
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding

from ..._core import mesh as _mesh
from ..._core.errors import PlacementError
from ..._layout import spec as _spec


class Blocks(NamedTuple):
    """Per dim: into how many shards it is cut, and the ones each process holds."""

    counts: tuple[int, ...]  # shards per dim (1: not sharded)
    axes: tuple[tuple[str, ...], ...]  # the mesh axes of each dim
    held: dict  # process index -> per dim, the sorted shard indices it holds


@ft.lru_cache(maxsize=512)
def blocks(sharding: NamedSharding, ndim: int) -> Blocks:
    entries = _spec.entries_of(sharding.spec)
    entries = (*entries, *(((),) * (ndim - len(entries))))
    sizes = _mesh.sizes(sharding.mesh)
    counts = tuple(math.prod(sizes[a] for a in entry) for entry in entries)
    if isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        # No devices, so no processes: this one holds every shard (a dry run of
        # the whole array, as `preflight`'s inputs are made).
        every = tuple(tuple(range(n)) for n in counts)
        return Blocks(counts, tuple(entries), {jax.process_index(): every})
    # With one element per shard, a device's index along a dim is its shard number.
    held: dict[int, list[set[int]]] = {}
    for device, index in sharding.devices_indices_map(counts).items():
        per_dim = held.setdefault(device.process_index, [set() for _ in counts])
        for d, part in enumerate(index):
            per_dim[d].add(part.start or 0)
    frozen = {p: tuple(tuple(sorted(s)) for s in dims) for p, dims in held.items()}
    return Blocks(counts, tuple(entries), frozen)


def _axes_text(axes: tuple[str, ...], sharding: NamedSharding) -> str:
    sizes = _mesh.sizes(sharding.mesh)
    return " x ".join(f"{a!r} ({sizes[a]})" for a in axes) or "no axis"


def _share(held: int, count: int, axes: str) -> str:
    processes = jax.process_count()
    if held == count:
        return (
            f"it is sharded over {axes} into {count} shards, all on this process "
            f"({processes} process{'es' if processes > 1 else ''})."
        )
    return (
        f"it is sharded over {axes} into {count} shards, {held} of them on this "
        f"process ({processes} processes), so this process loads {held}/{count} "
        "of the global dim."
    )


def global_shape_of(
    sharding: NamedSharding,
    local_shape: Sequence[int],
    given: Any,
    where: str,
) -> tuple[int, ...]:
    """The global shape that `local_shape` on this process is a block of.

    `given`: the user's override, or `None`. Raises `PlacementError`, naming the
    dim, its mesh axes and the size expected, before anything is built.
    """
    ndim = len(local_shape)
    info = blocks(sharding, ndim)
    me = jax.process_index()
    mine = info.held.get(me)
    if mine is None:
        raise PlacementError(
            f"{where}: process {me} holds no device of the mesh "
            f"{_mesh.format_mesh(sharding.mesh)}; only processes with devices in the "
            "mesh can place data on it."
        )
    if given is not None:
        given = tuple(int(n) for n in given)
        if len(given) != ndim:
            raise PlacementError(
                f"{where}: global_shape {given} has {len(given)} dims, the local "
                f"data {tuple(local_shape)} has {ndim}."
            )
    out = []
    for d in range(ndim):
        count, held = info.counts[d], len(mine[d])
        local = int(local_shape[d])
        axes = _axes_text(info.axes[d], sharding)
        if given is None:
            if local % held:
                raise PlacementError(
                    f"{where}: dim {d} of the local data has {local} elements, not "
                    f"a multiple of {held}: "
                    + _share(held, count, axes)
                    + f" Load a multiple of {held} there, or pass global_shape=."
                )
            out.append(local * count // held)
            continue
        total = given[d]
        if total % count:
            raise PlacementError(
                f"{where}: the global dim {d} has {total} elements, which {axes} "
                f"cannot split evenly into {count} shards. Make it a multiple of "
                f"{count}."
            )
        expected = total // count * held
        if local not in (expected, total):
            sizes = f"{expected}" if expected == total else f"{expected} or {total}"
            raise PlacementError(
                f"{where}: dim {d} of the local data has {local} elements, "
                f"expected {sizes} for a global size of {total}: "
                + _share(held, count, axes)
                + (
                    f" Load {expected} there."
                    if expected == total
                    else f" Load {expected} there (or the whole dim, {total})."
                )
            )
        out.append(total)
    return tuple(out)


def rows_of(sharding: NamedSharding, global_shape: Sequence[int], where: str) -> tuple:
    """The slices of the global array this process holds, one per dim."""
    ndim = len(global_shape)
    info = blocks(sharding, ndim)
    me = jax.process_index()
    mine = info.held.get(me)
    if mine is None:
        raise PlacementError(
            f"{where}: process {me} holds no device of the mesh "
            f"{_mesh.format_mesh(sharding.mesh)}."
        )
    out = []
    for d, total in enumerate(global_shape):
        count, held = info.counts[d], mine[d]
        if total % count:
            raise PlacementError(
                f"{where}: the global dim {d} has {total} elements, which "
                f"{_axes_text(info.axes[d], sharding)} cannot split evenly into "
                f"{count} shards. Make it a multiple of {count}."
            )
        size = total // count
        if list(held) != list(range(held[0], held[0] + len(held))):
            raise PlacementError(
                f"{where}: along dim {d} this process holds the shards {list(held)} "
                f"of {count}, not a contiguous run, so no single slice names its "
                "rows. Order the mesh's devices so each process's are adjacent "
                "(`jax.make_mesh` does)."
            )
        out.append(slice(held[0] * size, (held[-1] + 1) * size))
    return tuple(out)


def replica_groups(sharding: NamedSharding, ndim: int, full: Sequence[bool]) -> list:
    """Groups of processes that must hold equal local data (more than one each).

    `full[d]`: whether the local data holds the whole of dim `d`.
    """
    info = blocks(sharding, ndim)
    groups: dict = {}
    for process, held in sorted(info.held.items()):
        key = tuple(() if full[d] else held[d] for d in range(ndim))
        groups.setdefault(key, []).append(process)
    return [g for g in groups.values() if len(g) > 1]


def describe_leaf(dtype: Any, shape: Sequence[int], sharding: NamedSharding) -> str:
    return _spec.format_array(dtype, shape, _spec.entries_of(sharding.spec))
