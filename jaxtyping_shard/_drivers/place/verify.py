"""Cross-process checks of `place`'s inputs: equal shapes, and equal replicas.

`jax.make_array_from_process_local_data` checks each process's data against that
process alone; it cannot see a process whose batch is smaller than the others',
nor two replicas that loaded different data (JAX's docs: the result is then
wrong). These checks gather a few integers from every process (one tiny
all-gather each), so every process reaches the same verdict and raises the same
error: none is left waiting in a collective.
"""

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from ..._core.errors import PlacementError
from . import rows as _rows


_SHOWN = 16  # leaves whose shapes are gathered one by one, to name in messages
_RANK = 8


def _int32(value: int) -> int:
    return int(np.array(value & 0xFFFFFFFF, np.uint32).view(np.int32))


def _header(names: Sequence[str], leaves: Sequence[Any]) -> np.ndarray:
    summary = repr([(n, str(x.dtype), tuple(x.shape)) for n, x in zip(names, leaves)])
    row = [len(leaves), _int32(zlib.crc32(summary.encode()))]
    for x in list(leaves)[:_SHOWN]:
        shape = list(x.shape)[:_RANK]
        row += [x.ndim, *shape, *([-1] * (_RANK - len(shape)))]
    row += [-2] * (2 + _SHOWN * (_RANK + 1) - len(row))
    return np.array(row, np.int32)


def _shape_of(row: np.ndarray, i: int) -> str:
    base = 2 + i * (_RANK + 1)
    ndim = int(row[base])
    return str(tuple(int(n) for n in row[base + 1 : base + 1 + min(ndim, _RANK)]))


def check_shapes(names: Sequence[str], leaves: Sequence[Any], where: str) -> None:
    """Every process placing the same tree of the same local shapes and dtypes."""
    rows = np.asarray(multihost_utils.process_allgather(_header(names, leaves)))
    if (rows == rows[0]).all():
        return
    for i, name in enumerate(list(names)[:_SHOWN]):
        shapes = [_shape_of(row, i) for row in rows]
        if len(set(shapes)) > 1:
            per = ", ".join(f"process {p}: {s}" for p, s in enumerate(shapes))
            raise PlacementError(
                f"{where}: the processes hold local data of different shapes for "
                f"`{name}` ({per}). Every process must load the same number of "
                "rows: an uneven last batch, or a data loader that splits "
                "unevenly, would build a wrong global array. Drop or pad the "
                "remainder."
            )
    counts = ", ".join(f"process {p}: {int(r[0])} leaves" for p, r in enumerate(rows))
    raise PlacementError(
        f"{where}: the processes' local trees differ in structure, dtypes or "
        f"shapes ({counts}). Every process must place the same tree."
    )


def checksum(x: Any) -> int:
    data = np.ascontiguousarray(np.asarray(x))
    return _int32(zlib.crc32(data.data))  # contiguous: its buffer, no copy


def check_replicas(
    names: Sequence[str],
    leaves: Sequence[Any],
    shardings: Sequence[Any],
    global_shapes: Sequence[tuple],
    where: str,
) -> None:
    """Processes that hold the same part of an array hold the same data."""
    sums = np.array([checksum(x) for x in leaves], np.int32)
    rows = np.asarray(multihost_utils.process_allgather(sums))
    for i, (name, x, sharding, shape) in enumerate(
        zip(names, leaves, shardings, global_shapes)
    ):
        full = [a == b for a, b in zip(x.shape, shape)]
        for group in _rows.replica_groups(sharding, len(shape), full):
            values = {int(rows[p][i]) for p in group}
            if len(values) > 1:
                procs = ", ".join(str(p) for p in group)
                raise PlacementError(
                    f"{where}: `{name}` is "
                    f"`{_rows.describe_leaf(x.dtype, shape, sharding)}`, so processes "
                    f"{procs} hold the same part of it (replicas), but their local "
                    "data differ (checksums "
                    f"{', '.join(f'{int(rows[p][i]) & 0xFFFFFFFF:08x}' for p in group)}"
                    "). Load the same rows on replicas: use `jts.local_rows` to ask "
                    "which rows each process loads."
                )
