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
from ..._verdict.compare import agrees, contrast


def place_arguments(
    fname: str, pos: list, flat: list, in_leaves: Any, reshard: bool, abstract: bool
) -> tuple:
    """The arguments, placed as derived; committed mismatches refused (or moved,
    with `reshard`). `abstract` (for `lower`, `trace`, `eval_shape`): nothing is
    placed or moved; each leaf that would be becomes a `jax.ShapeDtypeStruct`
    with the derived sharding. A `jax.ShapeDtypeStruct` given with another
    sharding is refused (or given the derived one) as a committed array is."""
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
            if isinstance(leaf, jax.ShapeDtypeStruct):
                given = leaf.sharding
                if given is not None and agrees(given, sharding, len(leaf.shape)):
                    continue
                if given is not None and not reshard:
                    wrong.append(mismatch(_where(name, value, i), leaf, sharding))
                    continue
                moved[i], changed = _abstract(leaf, sharding), True
            elif not _committed(leaf):
                # NumPy and uncommitted arrays go where the annotation says,
                # as jit would move them; placed first, their types carry the
                # sharding (with Explicit axes, in_shardings alone do not).
                if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                    continue  # a Python scalar: jit places it
                if abstract:
                    moved[i] = _abstract(leaf, sharding)
                else:
                    moved[i] = jax.device_put(leaf, sharding)
                changed = True
            elif leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
                continue
            elif reshard:
                moved[i] = (
                    _abstract(leaf, sharding)
                    if abstract
                    else jax.device_put(leaf, sharding)
                )
                changed = True
            else:
                wrong.append(mismatch(_where(name, value, i), leaf, sharding))
        if changed:
            value = jax.tree_util.tree_unflatten(treedef, moved)
        values.append(value)
    if wrong:
        raise ShardingTypeCheckError(
            f"{fname}: {len(wrong)} argument"
            f"{'s are' if len(wrong) > 1 else ' is'} committed to a sharding "
            "(or, a `jax.ShapeDtypeStruct`, given one) other than the one its "
            "annotation asks for, and jit does not move committed arrays:\n"
            + "\n".join(f"  - {w}" for w in wrong)
            + "\nPlace the data as annotated (`jts.place`, or `jax.device_put(x, "
            "jts.sharding_of(annotation, mesh))`), or pass `reshard_inputs=True` "
            "to `jts.jit` to move it on every call."
        )
    return tuple(values)


def _where(name: str, value: Any, i: int) -> str:
    path = jax.tree_util.tree_flatten_with_path(value)[0][i][0]
    return name + jax.tree_util.keystr(path)


def _abstract(leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """The leaf as `jit` would see it placed: its shape, dtype and weak type."""
    weak = bool(getattr(leaf, "weak_type", False))
    return jax.ShapeDtypeStruct(
        tuple(leaf.shape), leaf.dtype, sharding=sharding, weak_type=weak
    )


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


def mismatch(name: str, leaf: Any, sharding: NamedSharding) -> str:
    entries = _spec.entries_of(sharding.spec)
    actual, expected, there = contrast(
        leaf.sharding, sharding, leaf.dtype, leaf.shape, entries
    )
    return (
        f"`{name}` is {actual}, its annotation asks for {expected} "
        f"({_spec.format_spec(sharding.spec)}, mesh "
        f"{_mesh.format_mesh(sharding.mesh)}{there})"
    )
