"""Device groups: read from a collective's HLO attributes, mapped to mesh axes.

XLA writes a collective's groups as lists (`replica_groups={{0,1},{2,3}}`), as
iota tile assignments (`[2,4]<=[4,2]T(1,0)`) or, in newer releases, over a mesh
of its own (`mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, with `device_ids=(...)`
when the devices are not in order, and sub-axes `'a':(pre)size`); all are
expanded to groups of partition ids. A partition is a position in the
executable's device assignment, the flattened devices of the mesh its
shardings name, so a group is mapped to the user's axes by the mesh
coordinates of its devices, never by the shape XLA gave its own mesh.
"""

import math
import re
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .._core import mesh as _mesh


_IOTA = re.compile(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
Groups = Optional[tuple[tuple[int, ...], ...]]  # partition ids; None: unread
_AXIS_REF = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def closing(text: str, open_at: int) -> int:
    """The index of the bracket closing the one at `open_at` (or the end)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def groups(attributes: str) -> Groups:
    """The device groups of `replica_groups=...`, as partition ids.

    `()` for `replica_groups={}` (all devices in one group: the caller knows how
    many there are); `None` if the attribute is absent or unreadable.
    """
    at = attributes.find("replica_groups=")
    if at < 0:
        return None
    value = attributes[at + len("replica_groups=") :]
    try:
        if value.startswith("{"):
            inner = value[1 : closing(value, 0)]
            return tuple(
                tuple(int(x) for x in g.split(",") if x.strip())
                for g in re.findall(r"\{([^{}]*)\}", inner)
            )
        if value.startswith("mesh["):
            return _mesh_groups(value)
        return _iota_groups(value)
    except (ValueError, IndexError):
        return None


def _iota_array(text: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """`[2,4]<=[4,2]T(1,0)` -> (the device ids in the order given, [2,4])."""
    match = _IOTA.match(text)
    if match is None:
        raise ValueError(text)
    dims = tuple(int(d) for d in match.group(1).split(","))
    reshape = (
        tuple(int(d) for d in match.group(2).split(",")) if match.group(2) else dims
    )
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if match.group(3):
        ids = ids.transpose([int(p) for p in match.group(3).split(",")])
    return ids.reshape(-1), dims


def _iota_groups(value: str) -> tuple[tuple[int, ...], ...]:
    ids, dims = _iota_array(value)
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(dims[0], -1))


def _mesh_groups(value: str) -> tuple[tuple[int, ...], ...]:
    """`mesh['a'=4,'b'=2], device_ids=([4,2]T(1,0)) {'a'}`: the devices of XLA's
    mesh grouped over the named axes (or sub-axes `'a':(pre)size`), as XLA's
    `MeshAxesReplicaGroupList` does."""
    match = _MESH.match(value)
    if match is None:
        raise ValueError(value)
    names, sizes = [], []
    for item in match.group(1).split(","):
        name, size = item.rsplit("=", 1)
        names.append(name.strip().strip("'"))
        sizes.append(int(size))
    count = math.prod(sizes)
    devices = (
        _iota_array(match.group(2).strip())[0] if match.group(2) else np.arange(count)
    )
    # Each mesh axis split into the parts that sub-axes name, in order.
    whole: set[str] = set()
    subs: dict[str, list[tuple[int, int]]] = {}
    for name, pre, sub in _AXIS_REF.findall(match.group(3)):
        if pre:
            subs.setdefault(name, []).append((int(pre), int(sub)))
        else:
            whole.add(name)
    split: list[int] = []
    grouped: list[int] = []
    for name, size in zip(names, sizes):
        if name in whole or name not in subs:
            if name in whole:
                grouped.append(len(split))
            split.append(size)
            continue
        done = 1
        for pre, sub in sorted(subs[name]):
            if pre != done:
                split.append(pre // done)
                done = pre
            grouped.append(len(split))
            split.append(sub)
            done *= sub
        if done != size:
            split.append(size // done)
    kept = [i for i in range(len(split)) if i not in grouped]
    arranged = devices.reshape(split).transpose(kept + grouped)
    per_group = math.prod(split[i] for i in grouped)
    return tuple(tuple(int(d) for d in row) for row in arranged.reshape(-1, per_group))


def pairs(attributes: str) -> tuple[tuple[int, int], ...]:
    at = attributes.find("source_target_pairs=")
    if at < 0:
        return ()
    value = attributes[at + len("source_target_pairs=") :]
    inner = value[1 : closing(value, 0)]
    return tuple(
        (int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", inner)
    )


def mesh_of(compiled: Any) -> Optional[Mesh]:
    """The mesh whose flattened devices are the executable's device assignment:
    that of its arguments' or results' `NamedSharding`s, else `jax.set_mesh`'s."""
    shardings = jax.tree_util.tree_leaves(
        (compiled.input_shardings, compiled.output_shardings)
    )
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return _mesh.concrete_context_mesh()


def explicit_axes(mesh: Optional[Mesh]) -> set[str]:
    """The mesh's `Explicit` axes (where JAX has unreduced values)."""
    types = getattr(mesh, "axis_types", None) or ()
    names = getattr(mesh, "axis_names", ())
    return {n for n, t in zip(names, types) if t == jax.sharding.AxisType.Explicit}


def num_partitions(text: str) -> int:
    head = text[: text.find("\n")]
    at = head.find("num_partitions=")
    return int(head[at + 15 :].split(",")[0].split()[0]) if at >= 0 else 1


def coordinates(mesh: Optional[Mesh]) -> Optional[np.ndarray]:
    """Each partition's position on the mesh: partition `p` is the `p`-th device
    of `mesh.devices.flat`, the executable's device assignment."""
    if mesh is None:
        return None
    shape = tuple(mesh.devices.shape)
    return np.stack(np.unravel_index(np.arange(mesh.size), shape), axis=1)


def axes(
    kind: str,
    groups: Groups,
    pairs: tuple[tuple[int, int], ...],
    coords: Optional[np.ndarray],
    mesh: Optional[Mesh],
    partitions: int,
) -> tuple[tuple[str, ...], str, int]:
    """The mesh axes a collective's device groups (or, for a collective-permute,
    its source-target pairs) span, those axes in words (`data (2 of 4)` when a
    group spans part of them), and the group size."""
    if kind == "collective-permute":
        sets = [(s, t) for s, t in pairs if s != t]
        size = len({d for pair in pairs for d in pair}) if pairs else 1
    elif groups is None:
        # Groups written in a form this reader does not know: said as "?", the
        # bytes counted as if over every device (an upper bound).
        return (), "?", partitions
    else:
        sets = list(groups)
        if not sets:  # `replica_groups={}`: every device, one group
            sets = [tuple(range(partitions))]
        size = max(len(g) for g in sets)
    if coords is None or mesh is None:
        return (), "", size
    varying: set[int] = set()
    for group in sets:
        if any(d >= len(coords) for d in group):
            return (), "", size
        at = coords[list(group)]
        varying.update(int(i) for i in np.flatnonzero((at != at[0]).any(axis=0)))
    names = tuple(mesh.axis_names[i] for i in sorted(varying))
    over = "+".join(names)
    spanned = int(np.prod([mesh.devices.shape[i] for i in varying]))
    if kind != "collective-permute" and names and size != spanned:
        over += f" ({size} of {spanned})"
    return names, over, size
