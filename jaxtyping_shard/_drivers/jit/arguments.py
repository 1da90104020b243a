"""A `jts.jit` call's arguments: their signature key, the shardings their
annotations ask for, and their placement (NumPy and uncommitted arrays placed,
committed ones checked with `is_equivalent_to` and refused by path, or moved
with `reshard_inputs=True`)."""

import inspect
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding

from ..._core import mesh as _mesh
from ..._core.errors import ShardingTypeCheckError
from ..._layout import bridge as _bridge, spec as _spec
from ..._layout.spec import has_sharding
from ..._verdict.compare import device_ids


def place_arguments(
    fname: str, pos: list, flat: list, in_leaves: Any, reshard: bool
) -> tuple:
    """The arguments, placed as derived; committed mismatches refused (or moved,
    with `reshard`)."""
    if in_leaves is None:
        return tuple(value for _, value, _ in pos)
    values, wrong = [], []
    for (name, value, _), f, shardings in zip(pos, flat, in_leaves):
        if f is None or shardings is None:
            values.append(value)
            continue
        leaves, treedef = f
        moved, changed = list(leaves), False
        for i, (leaf, sharding) in enumerate(zip(leaves, shardings)):
            if sharding is None or isinstance(leaf, Tracer):
                continue
            if not _committed(leaf):
                # NumPy and uncommitted arrays go where the annotation says,
                # as jit would move them; placed first, their types carry the
                # sharding (with Explicit axes, in_shardings alone do not).
                placed = _place_leaf(leaf, sharding)
                if placed is not leaf:
                    moved[i], changed = placed, True
                continue
            if leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
                continue
            if reshard:
                moved[i], changed = jax.device_put(leaf, sharding), True
            else:
                path = jax.tree_util.tree_flatten_with_path(value)[0][i][0]
                where = name + jax.tree_util.keystr(path)
                wrong.append(_mismatch(where, leaf, sharding))
        if changed:
            value = jax.tree_util.tree_unflatten(treedef, moved)
        values.append(value)
    if wrong:
        raise ShardingTypeCheckError(
            f"{fname}: {len(wrong)} argument"
            f"{'s are' if len(wrong) > 1 else ' is'} committed to a sharding "
            "other than the one its annotation asks for, and jit does not move "
            "committed arrays:\n" + "\n".join(f"  - {w}" for w in wrong) + "\n"
            "Place the data as annotated (`jts.place`, or `jax.device_put(x, "
            "jts.sharding_of(annotation, mesh))`), or pass `reshard_inputs=True` "
            "to `jts.jit` to move it on every call."
        )
    return tuple(values)


def statics(sig: inspect.Signature, kwargs: dict) -> tuple[set, set]:
    raw_nums: Any = kwargs.get("static_argnums", ()) or ()
    raw_names: Any = kwargs.get("static_argnames", ()) or ()
    nums = {raw_nums} if isinstance(raw_nums, int) else set(raw_nums)
    names = {raw_names} if isinstance(raw_names, str) else set(raw_names)
    params = list(sig.parameters)
    nums = {n % len(params) if params and n < 0 else n for n in nums}
    for i, name in enumerate(params):  # jax.jit infers each from the other
        if i in nums:
            names.add(name)
        if name in names:
            nums.add(i)
    return nums, names


def leaf_key(leaf: Any) -> Any:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    committed = getattr(leaf, "committed", None)  # in the key: see all_committed
    if committed:
        # A committed array's sharding, not just its being committed: a cached
        # entry leaves the comparison with `in_shardings` to JAX, which compares
        # HLO shardings and so accepts (and moves) an array on another device
        # order, or on one device where the annotation is replicated.
        committed = leaf.sharding
    return (type(leaf), None if shape is None else tuple(shape), dtype, committed)


def all_committed(flat: list, in_leaves: Any) -> bool:
    """Whether every leaf given a sharding is a committed array (none to place)."""
    if in_leaves is None:
        return False
    for f, shardings in zip(flat, in_leaves):
        if f is None or shardings is None:
            continue
        for leaf, sharding in zip(f[0], shardings):
            if sharding is not None and not _committed(leaf):
                return False
    return True


def hashable(value: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return (treedef, tuple(map(leaf_key, leaves)))


def _committed(leaf: Any) -> bool:
    return (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, Tracer)
        and getattr(leaf, "committed", False)
    )


def _place_leaf(leaf: Any, sharding: NamedSharding) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        if leaf.sharding is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.device_put(leaf, sharding)
    return leaf


def call_mesh(flat: list) -> Any:
    """The context's concrete mesh, else the mesh of a committed argument."""
    mesh = _mesh.set_concrete_mesh()
    if mesh is not None:
        return mesh
    for f in flat:
        for leaf in [] if f is None else f[0]:
            if _committed(leaf) and isinstance(leaf.sharding, NamedSharding):
                return leaf.sharding.mesh
    return _mesh.context_mesh()  # abstract inside another trace, or None


def leaf_sharding(
    leaf: Any, annotation: Any, mesh: Any, fname: str, name: str, path: tuple
) -> Any:
    if not has_sharding(annotation):
        return None  # unspecified: JAX chooses; never replicated behind the back
    if isinstance(annotation, NamedSharding):
        return annotation
    where = f"{fname}: {name}{jax.tree_util.keystr(path)}"
    if mesh is None:
        raise ValueError(
            f"{where} is annotated with a sharding, and jit needs a mesh for it: "
            "call under `jax.set_mesh(mesh)`, or pass arrays placed on the mesh."
        )
    # The leaf's shape, as a check of the value will resolve it (fallback lists).
    shape = tuple(getattr(leaf, "shape", ()))
    spec = _bridge.spec_for(annotation, shape, mesh, where)
    return _bridge.named_sharding(spec, mesh, annotation, where)


def _mismatch(name: str, leaf: Any, sharding: NamedSharding) -> str:
    actual = leaf.sharding
    spec = getattr(actual, "spec", None)
    shown = _spec.format_array(
        leaf.dtype, leaf.shape, _spec.entries_of(spec) if spec is not None else ()
    )
    if spec is None:
        shown += f" ({actual})"
    expected = _spec.format_array(
        leaf.dtype, leaf.shape, _spec.entries_of(sharding.spec)
    )
    mesh = _mesh.format_mesh(sharding.mesh)
    if shown == expected:  # the same layout over other devices: say which
        shown += f"` over devices {device_ids(actual)}"
        mesh += f" over devices {device_ids(sharding)}"
    else:
        shown += "`"
    return (
        f"`{name}` is `{shown}, its annotation asks for `{expected}` "
        f"({_spec.format_spec(sharding.spec)}, mesh {mesh})"
    )
