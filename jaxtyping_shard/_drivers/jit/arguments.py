"""A `jts.jit` call's arguments: their signature key, the shardings their
annotations ask for, and their placement (NumPy and uncommitted arrays placed,
committed ones checked with `is_equivalent_to` and refused by path, or moved
with `reshard_inputs=True`)."""

import inspect
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding

from ..._core import failures as _failures, mesh as _mesh
from ..._core.errors import ShardingAnnotationError, ShardingTypeCheckError
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
        paths: list = []  # the leaves' key paths, read once, at the first mismatch
        for i, (leaf, sharding) in enumerate(zip(leaves, shardings)):
            if sharding is None or isinstance(leaf, Tracer):
                continue
            spec_given = isinstance(leaf, jax.ShapeDtypeStruct)
            if not (_committed(leaf) or (spec_given and leaf.sharding is not None)):
                # NumPy and uncommitted arrays (and a `jax.ShapeDtypeStruct`
                # without a sharding) go where the annotation says, as jit would
                # move them; placed first, their types carry the sharding (with
                # Explicit axes, in_shardings alone do not).
                if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                    continue  # a Python scalar: jit places it
                moved[i], changed = _moved(leaf, sharding, abstract), True
                continue
            if agrees(leaf.sharding, sharding, len(leaf.shape)):
                continue
            if not paths:
                paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(value)[0]]
            where = name + jax.tree_util.keystr(paths[i])
            # `jts.preflight` lists it with every other failure, and goes on as if
            # it were placed as annotated.
            collected = not reshard and _failures.collect(
                f"argument {mismatch(where, leaf, sharding, f' of `{fname}`')}"
            )
            if reshard or collected:
                moved[i], changed = _moved(leaf, sharding, abstract), True
            else:
                wrong.append(mismatch(where, leaf, sharding))
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


def _moved(leaf: Any, sharding: NamedSharding, abstract: bool) -> Any:
    """The leaf placed as derived: as a `jax.ShapeDtypeStruct` when it is one or
    `abstract` (nothing is moved), else `device_put`."""
    if abstract or isinstance(leaf, jax.ShapeDtypeStruct):
        return _abstract(leaf, sharding)
    return jax.device_put(leaf, sharding)


def _abstract(leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """The leaf as `jit` would see it placed: its shape, dtype and weak type."""
    weak = bool(getattr(leaf, "weak_type", False))
    return jax.ShapeDtypeStruct(
        tuple(leaf.shape), leaf.dtype, sharding=sharding, weak_type=weak
    )


def options(jit_kwargs: dict, annotations: str) -> tuple[dict, bool, Any, bool, bool]:
    """`(jit's own keyword arguments, reshard_inputs, stacked, in_shardings
    derived, out_shardings derived)` of `jts.jit`'s keyword arguments, where
    `annotations` is the one string `in_shardings` and `out_shardings` take."""
    kwargs = dict(jit_kwargs)
    reshard = bool(kwargs.pop("reshard_inputs", False))
    stacked = kwargs.pop("stacked", None)
    for key in ("in_shardings", "out_shardings"):
        value = kwargs.get(key)
        if isinstance(value, str) and value != annotations:
            raise ValueError(
                f"{key}={value!r}: the only string accepted is "
                f"{annotations!r} (shardings read off the signature)."
            )
    derive_in = kwargs.get("in_shardings") == annotations
    derive_out = kwargs.get("out_shardings") == annotations
    if reshard and not derive_in:
        raise ValueError(
            "reshard_inputs=True needs in_shardings='annotations': it moves "
            "arguments to the shardings their annotations ask for."
        )
    for key in ("in_shardings", "out_shardings"):
        if kwargs.get(key) == annotations:
            del kwargs[key]
    return kwargs, reshard, stacked, derive_in, derive_out


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


def leaf_shardings(
    leaves: list, annotations: Any, plan: Any, mesh: Any, fname: str, name: str
) -> list:
    """`leaf_sharding` of each leaf of one argument (or the result), given the
    annotations to lay them out by (the plan's, or `jts.Like`'s)."""
    rows = zip(leaves, annotations, plan.paths)
    return [leaf_sharding(x, ann, mesh, fname, name, path) for x, ann, path in rows]


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


def indivisible(name: str, leaves: list, shardings: list, paths: tuple) -> list[str]:
    """`name<path>: why` for each leaf whose derived sharding does not divide it."""
    out = []
    for leaf, sharding, path in zip(leaves, shardings, paths):
        shape = getattr(leaf, "shape", None)
        if sharding is None or shape is None:
            continue
        sizes = _mesh.sizes(sharding.mesh)
        why = _spec.indivisible(tuple(shape), sharding.spec, sizes, leaf.dtype)
        if why is not None:
            out.append(f"{name}{jax.tree_util.keystr(path)}: {why}")
    return out


def raise_indivisible(fname: str, what: str, problems: list, mesh: Any) -> None:
    """One error for every leaf its annotation cannot lay out on `mesh`, before
    JAX refuses the first without naming it."""
    if problems:
        raise ShardingAnnotationError(
            f"{fname}: {len(problems)} of its {what} cannot be laid out as "
            f"annotated on the mesh {_mesh.format_mesh(mesh)}:\n"
            + "\n".join(f"  {p}" for p in problems)
        )


def mismatch(name: str, leaf: Any, sharding: NamedSharding, of: str = "") -> str:
    """`name` (`of` the function, when given) laid out otherwise than `sharding`,
    in JAX's notation, with what differs where the notation is the same."""
    entries = _spec.entries_of(sharding.spec)
    actual, expected, there = contrast(
        leaf.sharding, sharding, leaf.dtype, leaf.shape, entries
    )
    return (
        f"`{name}`{of} is {actual}, its annotation asks for {expected} "
        f"({_spec.format_spec(sharding.spec)}, mesh "
        f"{_mesh.format_mesh(sharding.mesh)}{there})"
    )
