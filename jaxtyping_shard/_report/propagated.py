"""Auto axes: the layout XLA's sharding propagation gave each instruction.

Nothing is added to the program: the step is compiled once more with XLA's
debug options asking for the module as it stands after propagation
(`xla_dump_to`, `xla_dump_hlo_pass_re`: the `shardy-xla` pass with Shardy,
`sharding-propagation` with GSPMD), as text and as a serialized proto, in a
temporary directory. Debug options change no pass (the compiled module is the
same text, tested); the text gives each instruction's `sharding={...}`, the
proto its frames (`sources.py`). A sharding is mapped to the mesh's axis names
by the mesh coordinates of the devices in its tiles, as collectives' groups
are (`groups.py`), and kept only where that reading reproduces every tile.
"""

import glob
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .._core import compat as _compat
from . import groups as _groups, hlo as _hlo
from .sources import _fields, Frame, Sources


# The passes after which the module holds the propagated shardings.
_PASSES = ("shardy-xla", "sharding-propagation")
_SHARDING = re.compile(r"\bsharding=\{")
# Instructions that only pass a value on or hold the program's structure.
_SKIP = frozenset(
    {"parameter", "get-tuple-element", "tuple", "constant", "while", "conditional"}
    | {"call", "after-all", "partition-id", "replica-id", "iota"}
)
MANUAL = "manual"  # a value inside `shard_map`: its layout is the body's own


@dataclass(frozen=True)
class Raw:
    """One instruction of the propagated module and its layout."""

    name: str
    op: str  # the JAX primitive it was lowered from (`dot_general`)
    dtype: str  # XLA's element type
    dims: tuple[int, ...]
    entries: Any  # mesh axes per dim; MANUAL; None: not read
    sharding: str  # as XLA wrote it
    stack: tuple[Frame, ...]


def compile_dumped(lowered: Any) -> tuple[Any, Optional[str], Optional[bytes]]:
    """`lowered` compiled with the module after propagation dumped: the
    executable, the module's text and its `HloModuleProto` (None: not written,
    as when the compile came from a cache)."""
    folder = tempfile.mkdtemp(prefix="jts-layouts-")
    try:
        with _compat.without_persistent_cache():
            compiled = lowered.compile(
                compiler_options={
                    "xla_dump_to": folder,
                    "xla_dump_hlo_pass_re": "|".join(_PASSES),
                    "xla_dump_hlo_as_text": True,
                    "xla_dump_hlo_as_proto": True,
                }
            )
        found = sorted(
            path
            for stage in _PASSES
            for path in glob.glob(os.path.join(folder, f"*.after_{stage}.*.txt"))
        )
        if not found:
            return compiled, None, None
        # The last dump of the pass (GSPMD may run it more than once).
        text_path = found[-1]
        with open(text_path, encoding="utf-8") as file:
            text = file.read()
        proto = None
        proto_path = text_path[: -len(".txt")] + ".hlo.pb"
        if os.path.exists(proto_path):
            with open(proto_path, "rb") as file:
                proto = _module_of(file.read())
        return compiled, text, proto
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _module_of(data: bytes) -> bytes:
    """The `HloModuleProto` inside the `HloProto` XLA dumps (its field 1)."""
    for field, value in _fields(data, 0, len(data)):
        if field == 1 and isinstance(value, tuple):
            return data[value[0] : value[1]]
    return data


def read(text: str, proto: Optional[bytes], mesh: Any) -> list[Raw]:
    """Every array instruction of the module with a JAX operation behind it, in
    the computations that run (the entry, `while` bodies, branches, calls; not
    the scalar functions of reductions), with its layout on `mesh`."""
    module = _hlo._Module(text)
    sources = Sources(proto) if proto is not None else None
    coords = _groups.coordinates(mesh)
    out = []
    if module.entry is None:
        return []
    # The computations that run (a copy XLA left uncalled is not the program's).
    runs = _hlo._executions(module, module.entry)[0]
    for computation in runs:
        for instruction in module.body(computation):
            if instruction.opcode in _SKIP:
                continue
            found = _SHARDING.search(instruction.attributes)
            shapes = _hlo.arrays(instruction.shape)
            if found is None or len(shapes) != 1 or "(" in instruction.shape:
                continue
            named = _hlo._OP_NAME.search(instruction.attributes)
            if named is None or "/" not in named.group(1):
                continue  # no JAX operation behind it (an argument's name)
            op = named.group(1).rpartition("/")[2]
            start = found.end() - 1
            sharding = instruction.attributes[
                start : _groups.closing(instruction.attributes, start) + 1
            ]
            dtype, dims = shapes[0]
            stack = sources.stack(instruction.name) if sources is not None else ()
            out.append(
                Raw(
                    instruction.name,
                    op,
                    dtype,
                    dims,
                    entries(sharding, len(dims), coords, mesh),
                    sharding,
                    stack,
                )
            )
    return out


def entries(sharding: str, rank: int, coords: Any, mesh: Any) -> Any:
    """The mesh axes of each dim of an array of `rank` laid out as `sharding`
    (`{devices=[4,1,2]<=[8] last_tile_dim_replicate}`), MANUAL inside a
    `shard_map`, or None where it cannot be read as mesh axes."""
    body = sharding.strip()[1:-1].strip()
    if body == "replicated":
        return ((),) * rank
    if body == MANUAL:
        return MANUAL
    if body.startswith("mesh["):
        return _named(body, rank, mesh)
    if not body.startswith("devices=[") or mesh is None or coords is None:
        return None
    try:
        close = body.index("]")
        dims = tuple(int(d) for d in body[len("devices=[") : close].split(","))
        rest = body[close + 1 :]
        if rest.startswith("<="):
            spec = body[len("devices=") :].split()[0]
            ids = _groups._iota_array(spec)[0]
        else:
            listed = rest.split()[0] if rest.split() else ""
            ids = np.array([int(d) for d in listed.split(",") if d])
    except (ValueError, IndexError):
        return None
    trailing = 0
    if "last_tile_dim_replicate" in rest:
        trailing = 1
    elif "last_tile_dims={" in rest:
        kinds = rest[rest.index("last_tile_dims={") + 16 :].split("}")[0]
        if MANUAL in kinds:
            return MANUAL
        trailing = len([k for k in kinds.split(",") if k.strip()])
    if len(dims) - trailing != rank or ids.size != math.prod(dims):
        return None
    if ids.size and int(ids.max()) >= len(coords):
        return None
    return _axes(ids.reshape(dims), rank, coords, mesh)


_NAMED = re.compile(r"mesh\[([^\]]*)\]\s*,\s*(.*)$", re.S)


def _named(body: str, rank: int, mesh: Any) -> Any:
    """XLA's named form (JAX >= 0.12): `mesh['data'=4,'model'=2], [{'data'},
    {}]` with the mesh's own names; read where XLA's mesh is the user's (same
    names and sizes, devices in order) and no dim holds a sub-axis."""
    match = _NAMED.match(body)
    if match is None:
        return None
    rest = match.group(2).strip()
    if rest.startswith("replicated") or not match.group(1).strip():
        return ((),) * rank if rest.startswith("replicated") else None
    if rest.startswith(MANUAL) or "manual_axes" in rest:
        return MANUAL
    if mesh is None or "device_ids" in rest or not rest.startswith("["):
        return None
    sizes = [
        (name.strip().strip("'"), int(size))
        for name, size in (i.rsplit("=", 1) for i in match.group(1).split(","))
    ]
    if sizes != list(zip(mesh.axis_names, mesh.devices.shape)):
        return None
    dims = re.findall(r"\{([^{}]*)\}", rest[: _groups.closing(rest, 0) + 1])
    if len(dims) != rank or ":" in rest[: _groups.closing(rest, 0) + 1]:
        return None
    return tuple(
        tuple(a.strip().strip("'") for a in dim.split(",") if a.strip()) for dim in dims
    )


def _axes(tiles: np.ndarray, rank: int, coords: np.ndarray, mesh: Any) -> Any:
    """The axes each tensor dim of `tiles` (device ids, one dim per tensor dim
    then the replicated ones) is split over, major first; None unless they
    reproduce the position of every tile."""
    names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    at = coords[tiles.reshape(-1)]  # (tiles, mesh axes)
    position = np.stack(np.unravel_index(np.arange(tiles.size), tiles.shape), axis=1)
    used: set[int] = set()
    out = []
    for dim in range(rank):
        if tiles.shape[dim] == 1:
            out.append(())
            continue
        origin = [0] * tiles.ndim
        line = []
        for j in range(tiles.shape[dim]):
            origin[dim] = j
            line.append(int(tiles[tuple(origin)]))
        along = coords[line]
        varying = [a for a in range(len(names)) if (along[:, a] != along[0, a]).any()]
        # Major first: the axis that changes last along the dim.
        first_change = {
            a: int(np.flatnonzero(along[:, a] != along[0, a])[0]) for a in varying
        }
        order = sorted(varying, key=lambda a: -first_change[a])
        if used & set(order) or math.prod(sizes[a] for a in order) != tiles.shape[dim]:
            return None
        used.update(order)
        index = np.zeros(len(at), dtype=np.int64)
        for a in order:
            index = index * sizes[a] + at[:, a]
        if not (index == position[:, dim]).all():
            return None
        out.append(tuple(names[a] for a in order))
    return tuple(out)
