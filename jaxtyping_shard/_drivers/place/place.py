"""`place`, `place_for`, `local_rows`: host-local data laid out as annotated.

The layout is read off the annotation (the one tree walk, then the one
annotation -> spec -> `NamedSharding` path of `_bridge`); the global array is
built by `jax.make_array_from_process_local_data`. Sizes are checked first
(`_rows`), across processes on request (`_verify`).
"""

from collections.abc import Callable, Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ..._core import compat, mesh as _mesh
from ..._core.errors import PlacementError, ShardingAnnotationError
from ..._layout import bridge as _bridge, given as _given
from ..._layout.spec import has_sharding
from ..._rules import scope as _rules
from ..._trees import (
    check_tree as _check_tree,
    leaves as _leaves,
    paths as _paths,
    walk as _tree,
)
from ..._trees.signature import function_name as _name, parameter_hint
from .. import reshard as _reshard
from . import rows as _rows, verify as _verify


_VERIFY = (None, False, "shapes", "checksum")


@_rules.per_call  # axis_rules=: the call runs under that table
def place(
    local: Any,
    annotations: Any,
    mesh: Any = None,
    *,
    global_shape: Any = None,
    verify: Optional[str] = "shapes",
    rules: Optional[Mapping[str, Any]] = None,
    strict: bool = False,
    axis_rules: Any = None,
) -> Any:
    """Host-local data as global arrays, laid out as the annotations say.

    Each process passes the part of the data it loaded; the result is the global
    `jax.Array` (or tree of them) sharded as annotated, built with
    `jax.make_array_from_process_local_data`. On one process the local data is
    the whole array, and the call means the same: place it as annotated.

    !!! Example

        ```python
        import jax
        import numpy as np
        import jaxtyping_shard as jts
        from jax.sharding import AxisType, PartitionSpec as P
        from jaxtyping import Array
        from jaxtyping_shard import Int

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        Tokens = Int[Array, "batch seq", P("data", None)]
        rows = jts.local_rows(Tokens, (16, 8), mesh)  # this process's rows
        local = np.arange(16 * 8, dtype=np.int32).reshape(16, 8)[rows]
        tokens = jts.place(local, Tokens, mesh)
        assert tokens.shape == (16, 8) and isinstance(tokens, Tokens)
        ```

    **Arguments:**

    - `local`: this process's data: a NumPy (or JAX) array, or a pytree of them.
    - `annotations`: what the global arrays are: a sharded annotation
        (`Int[Array, "batch seq", P(("data", "fsdp"), None)]`), a
        `PartitionSpec`, a `NamedSharding`, a type hint (`dict[str, ...]`, an
        annotated dataclass) or a tree of those, a prefix of `local`'s tree, as for
        [`jaxtyping_shard.shardings`][]. A leaf whose annotation declares no
        sharding (none, `Any`, a third-party class's field such as an optax
        state's `count`) is placed replicated, as `sharded_init` creates it.
    - `mesh`: omitted: the context mesh (`jax.set_mesh`). On a
        `jax.sharding.AbstractMesh` (no devices) this process counts as holding
        every shard, and the result is the `jax.ShapeDtypeStruct` of the global
        array, nothing placed; inside a trace (an input pipeline under
        `jax.eval_shape`, for [`jaxtyping_shard.preflight`][]), the data (the
        whole array, one process) is laid out as annotated in the computation.
    - `global_shape`: omitted: computed from the local shape, the sharding and
        the mesh (a dim cut into `n` shards of which this process holds `k` is
        `n / k` times the local dim). Given (a shape, or a tree of shapes like
        `local`): each local dim must be this process's part or the whole dim.
    - `verify`: with several processes, `"shapes"` (default): all processes
        compare local shapes and dtypes first (one small all-gather, so every
        process must call `place` with the same tree); `"checksum"`: also a CRC32
        of each process's data, so replicas (processes holding the same part)
        that hold different data are caught; `None`: no cross-process check
        (what `jax.make_array_from_process_local_data` does). On one process
        there is nothing to compare and nothing runs.
    - `rules`: path rules, as for [`jaxtyping_shard.shardings`][].
    - `strict`: `True`: a leaf whose annotation declares no sharding is an error
        instead of placed replicated.
    - `axis_rules`: as for [`jaxtyping_shard.check_tree`][].

    **Returns:**

    A `jax.Array` (or a tree of them, of `local`'s structure) of the global shape,
    sharded as annotated.

    **Raises:**

    [`jaxtyping_shard.PlacementError`][] before anything is built when a local
    size does not fit the sharding and the process count (the message gives the
    size expected and the mesh axes), a global size is not divisible by its
    shard count, the global array would fail its own annotation (a dtype, a
    fixed dim, a dim name bound twice to different sizes), or the verification
    fails.
    [`jaxtyping_shard.ShardingAnnotationError`][] when a leaf names an axis the
    mesh lacks, or (`strict=True`) has no sharding.
    """
    return _place(
        local, annotations, mesh, global_shape, verify, rules, "place", strict
    )


def place_for(
    fn: Callable,
    parameter: str,
    local: Any,
    mesh: Any = None,
    *,
    global_shape: Any = None,
    verify: Optional[str] = "shapes",
) -> Any:
    """`place(local, <the annotation of fn's parameter>)`: the consumer's layout.

    The sharding is written once, in the signature of the function that consumes
    the data; the input pipeline reads it from there.

    !!! Example

        ```python
        from jaxtyping_shard import Float

        def train_step(batch: Float[Array, "batch embed", P("data", None)]):
            return batch.sum()

        batch = jts.place_for(train_step, "batch", np.ones((8, 4), np.float32), mesh)
        assert batch.sharding.spec == P("data", None)
        ```

    **Arguments:**

    - `fn`: a function with annotated parameters (decorated with `jaxtyped`,
        `jax.jit` or `jaxtyping_shard.jit` is fine: wrappers are unwrapped).
    - `parameter`: the parameter's name.
    - the rest: as for [`jaxtyping_shard.place`][].

    **Raises:**

    As `place`, and [`jaxtyping_shard.ShardingAnnotationError`][] when `fn` has no
    such parameter or it is not annotated.
    """
    hint = parameter_hint(fn, parameter, "place_for")
    where = f"place_for({_name(fn)}, {parameter!r})"
    return _place(local, hint, mesh, global_shape, verify, None, where, True)


def local_rows(annotation: Any, global_shape: Any, mesh: Any = None) -> tuple:
    """Which part of the global array this process loads, one slice per dim.

    Processes that are replicas of each other (the batch replicated over `model`
    spanning processes, say) get the same slices.

    !!! Example

        ```python
        rows = jts.local_rows(Float[Array, "b e", P("data", None)], (8, 4), mesh)
        assert rows == (slice(0, 8), slice(0, 4))  # one process holds everything
        ```

    **Arguments:**

    - `annotation`: a sharded annotation, `PartitionSpec` or `NamedSharding`.
    - `global_shape`: the global array's shape.
    - `mesh`: omitted: the context mesh. On an `AbstractMesh`, every row.

    **Returns:**

    A tuple of `slice`s, one per dim: `data[rows]` is what this process passes to
    [`jaxtyping_shard.place`][]. `rows[0]` is the batch rows.

    **Raises:**

    [`jaxtyping_shard.PlacementError`][] when a dim is not divisible by its shard
    count, or this process's shards of a dim are not contiguous.
    """
    shape = tuple(int(n) for n in global_shape)
    sharding = _sharding(annotation, mesh, shape, "local_rows")
    return _rows.rows_of(sharding, shape, "local_rows")


def _sharding(annotation: Any, mesh: Any, shape: tuple, where: str) -> NamedSharding:
    """The sharding of the global array of `shape` (logical names resolved for
    that shape, as a check of the array will resolve them)."""
    if isinstance(annotation, NamedSharding) and mesh is None:
        return annotation
    if not has_sharding(annotation):
        raise ShardingAnnotationError(
            f"{where}: {_given.describe(annotation)} has no sharding, so it says "
            "nowhere to place the data. Annotate it, `P()` for replicated."
        )
    mesh = _place_mesh(mesh, where)
    spec = _bridge.spec_for(annotation, shape, mesh, where)
    return _bridge.named_sharding(spec, mesh, annotation, where)


_layouts: dict = {}
_LAYOUT_LIMIT = 512
# How many times the global shape may change the resolution before `place` asks
# for `global_shape=` (see `_resolved`).
_ROUNDS = 3


def _layout(annotation, checker, mesh, x, given, where) -> tuple:
    """`(sharding, global shape, why the data does not fit its annotation or "")`
    of one leaf; cached, as a data loader calls `place` every step (the same
    `NamedSharding` object also keeps JAX's own `device_put` caches warm)."""
    context = _mesh.set_concrete_mesh() if mesh is None else None
    try:
        key: Any = (
            annotation,
            mesh,
            context,  # the context mesh, when it is the one used
            tuple(x.shape),
            x.dtype,
            None if given is None else tuple(given),
            _rules.current(),  # logical annotations resolve through the rules
        )
        hit = _layouts.get(key)
    except TypeError:  # an unhashable annotation or shape
        key, hit = None, None
    if hit is not None:
        return hit
    sharding, shape = _resolved(annotation, mesh, x.shape, given, where)
    out = (sharding, shape, _misfit(checker, x, shape, sharding, where))
    if key is not None:
        if len(_layouts) >= _LAYOUT_LIMIT:
            _layouts.clear()
        _layouts[key] = out
    return out


def _resolved(annotation, mesh, local_shape, given, where) -> tuple:
    """The sharding, and the global shape it makes of the local data, resolved
    for that global shape (as a check of the array will resolve it).

    With `global_shape=`, that shape. Otherwise it depends on the sharding (on
    one process it is the local shape; on several, a dim split over processes
    is a multiple of it), so the two are found together: a sharding whose global
    shape resolves to itself, starting from the rules' first choice (by rank),
    else from the local shape."""
    local = tuple(local_shape)
    if given is not None and len(given) == len(local):
        starts: list = [tuple(int(n) for n in given)]
    else:
        starts = [len(local), local]
    error: Optional[Exception] = None
    for shape in starts:
        try:
            for _ in range(_ROUNDS):
                sharding = _sharding(annotation, mesh, shape, where)
                found = _rows.global_shape_of(sharding, local, given, where)
                if found == shape:
                    return sharding, shape
                shape = found
        except (PlacementError, ShardingAnnotationError) as failed:
            # The local data does not fit that sharding, or the rules find none
            # for that shape (a fallback the rank alone cannot choose): the next
            # start; the last one's error is the answer.
            error = failed
    raise error or PlacementError(
        f"{where}: the sharding of {_given.describe(annotation)} under the axis "
        "rules in force depends on the global shape, which depends on the "
        "sharding, and no choice is consistent for the local data of shape "
        f"{local}. Pass `global_shape=`."
    )


def _misfit(checker: Any, x: Any, shape: tuple, sharding: Any, where: str) -> str:
    """Why the global array the local data would make fails its own annotation
    (dtype, fixed dims, dim names bound within it; its sharding, resolved as a
    check resolves it), "" when it fits. Checked on a `jax.ShapeDtypeStruct`:
    nothing is built."""
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # what the array will hold
    abstract = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    failures = _leaves.leaf_failures([abstract], ((),), (checker,), where)
    return failures[0][1] if failures else ""


def _place_mesh(mesh: Any, where: str) -> Any:
    mesh = _bridge.resolve_mesh(mesh, where)
    if not isinstance(mesh, (jax.sharding.Mesh, AbstractMesh)):
        raise ValueError(
            f"{where} needs a mesh (a `Mesh`, or an `AbstractMesh` for a dry run), "
            f"not {mesh}: pass `mesh=`, or call it under `jax.set_mesh(mesh)`."
        )
    return mesh


def _global_shapes(given: Any, count: int, where: str) -> list:
    if given is None:
        return [None] * count
    shapes = jax.tree_util.tree_leaves(
        given, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )
    if count == 1 and len(shapes) != 1 and all(isinstance(n, int) for n in shapes):
        shapes = [tuple(shapes)]  # a bare shape for a single array
    if len(shapes) != count:
        raise PlacementError(
            f"{where}: global_shape gives {len(shapes)} shapes for {count} arrays; "
            "give one shape, or a tree of shapes (None: computed) like the data."
        )
    return list(shapes)


def _place(local, annotations, mesh, global_shape, verify, rules, where, strict) -> Any:
    if verify not in _VERIFY:
        raise ValueError(
            f"{where}: verify must be 'shapes', 'checksum' or None, not {verify!r}."
        )
    leaves, plan = _tree.plan_for(local, annotations, rules)
    _tree.refuse_problems(leaves, plan, where, "local")
    checkers = _check_tree.checkers_of(plan)
    arrays = [x if hasattr(x, "shape") else np.asarray(x) for x in leaves]
    names = [_paths.path_name("local", p) for p in plan.paths]
    givens = _global_shapes(global_shape, len(arrays), where)
    shardings, shapes, misfits = [], [], []
    rows = zip(names, arrays, plan.annotations, checkers, givens)
    for name, x, annotation, checker, given in rows:
        label = f"{where}: {name}" if plan.paths else where
        if not has_sharding(annotation):
            if strict:
                raise ShardingAnnotationError(
                    f"{label} has no sharding in its annotation "
                    f"({_given.describe(annotation)}), so it has nowhere to go "
                    "(strict). Annotate it; `P()` places it replicated."
                )
            annotation = PartitionSpec()  # declares nothing: replicated
        sharding, shape, misfit = _layout(annotation, checker, mesh, x, given, label)
        shardings.append(sharding)
        shapes.append(shape)
        if misfit:
            misfits.append(f"  {name}: {misfit}")
    if misfits:
        head = (
            "the local data would not be what its annotation says"
            if len(arrays) == 1
            else f"{len(misfits)} of {len(arrays)} arrays of the local data would "
            "not be what their annotations say"
        )
        raise PlacementError(
            f"{where}: {head} (checked as the global array, of the dtype JAX would "
            "give it; nothing was placed):\n" + "\n".join(misfits)
        )
    if not compat.top_level() or any(
        isinstance(s.mesh, AbstractMesh) for s in shardings
    ):
        out = [
            _unplaced(s, x, shape, name)
            for s, x, shape, name in zip(shardings, arrays, shapes, names)
        ]
        return jax.tree_util.tree_unflatten(plan.treedef, out)
    if verify and jax.process_count() > 1:  # one process: nothing to compare
        _verify.check_shapes(names, arrays, where)
        if verify == "checksum":
            _verify.check_replicas(names, arrays, shardings, shapes, where)
    out = [
        jax.make_array_from_process_local_data(s, x, shape)
        for s, x, shape in zip(shardings, arrays, shapes)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def _unplaced(sharding: NamedSharding, x: Any, shape: tuple, where: str) -> Any:
    """Inside a trace (an input pipeline under `jax.eval_shape`, say), `x` laid
    out as annotated in the computation; on an `AbstractMesh` (no devices),
    outside one, the `jax.ShapeDtypeStruct` of the array `place` would make."""
    if compat.top_level():
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
    if tuple(x.shape) != tuple(shape):
        raise PlacementError(
            f"{where}: inside a trace, place lays out the whole array, which this "
            f"process does not hold (local {tuple(x.shape)}, global {shape}). Place "
            "the data outside the trace."
        )
    return _reshard.reshard(jnp.asarray(x), sharding)
