"""`sharded_init` and `abstract`: create a tree of parameters where it will live.

The steps, each reusing the one path from annotation to sharding:

1. Trace `fn` (`jax.eval_shape`) on an all-`Auto` copy of the mesh: no data, and
   `fn`'s checks are compile-time ones, never run there (no false alarm).
2. One `NamedSharding` per array leaf (tree walk, bridge: `plan.py`); every leaf
   that cannot be laid out is reported before compiling.
3. Compile `fn` once with those `out_shardings`; on `Explicit` axes inside
   `jax.sharding.auto_axes`, where XLA creates each parameter in shards (a plain
   `jit` there materialises every full one first) and the module's own checks
   run when XLA compiles, on the layout it chose (`ShardingTypeCheckError`).
4. Verify every leaf of the result against its sharding (metadata only).
"""

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ..._core import compat, mesh as _mesh
from ..._core.errors import ShardingTypeCheckError, ShardingWarning
from ..._core.modes import current_mode
from ..._layout import bridge as _bridge, spec as _spec
from ..._rules.scope import per_call_step as _per_call_step
from . import lowering as _lowering, plan as _init_plan
from .trace import abstract_shapes, run_deferred, Traced


@dataclasses.dataclass(frozen=True)
class Request:
    """One call of `sharded_init` or `abstract`: `fn`, its arguments, the options
    (their meaning is in `sharded_init`'s docstring) and the caller's name."""

    fn: Callable
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Any = None
    annotations: Any = None
    rules: Optional[Mapping[str, Any]] = None
    stacked: Optional[Mapping[str, Any]] = None
    strict: bool = False
    what: str = "sharded_init"
    like: Any = None


class Plan(NamedTuple):
    """What a `Request` creates, decided before compiling."""

    mesh: Any  # a Mesh; an AbstractMesh for `abstract`
    traced: Traced
    abstract_tree: Any  # `jax.ShapeDtypeStruct` array leaves, no shardings
    shardings: list  # per leaf of `abstract_tree`: a NamedSharding, or None


def _concrete_mesh(mesh: Any, what: str) -> Mesh:
    mesh = _bridge.resolve_mesh(mesh, what)
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"{what} needs a concrete `jax.sharding.Mesh` (devices, not only axis "
            f"names), not {type(mesh).__name__}: pass `mesh=`, or call it outside "
            "`jit` under `jax.set_mesh(mesh)`. On an `AbstractMesh`, "
            "`jts.abstract` gives what it would create (shapes and shardings)."
        )
    return mesh


def _any_mesh(mesh: Any, what: str) -> Any:
    mesh = _bridge.resolve_mesh(mesh, what)
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(
            f"{what} needs a `jax.sharding.Mesh` or `AbstractMesh`, not "
            f"{type(mesh).__name__}."
        )
    return mesh


def plan(request: Request) -> Plan:
    """Traces `fn` with no data and lays out every leaf (errors before compiling).
    An `AbstractMesh` (no devices) is for `abstract`, and inside a trace."""
    if request.what == "abstract" or not compat.top_level():
        mesh = _any_mesh(_init_plan.mesh_of(request), request.what)
    else:
        mesh = _concrete_mesh(_init_plan.mesh_of(request), request.what)
    abstract = request.what == "abstract"
    traced = Traced(request.fn, request.args, dict(request.kwargs), abstract)
    tree = abstract_shapes(traced, mesh)
    like = _init_plan.like_of(request, tree)
    shardings = _init_plan.leaf_shardings(
        tree,
        mesh,
        request.annotations,
        request.rules,
        request.stacked,
        request.strict,
        request.what,
        like,
    )
    return Plan(mesh, traced, tree, shardings)


def compile_init(request: Request) -> tuple[Any, Callable[[], Any]]:
    """`(compiled, run)`: the compiled init (for `memory_analysis()`) and a thunk
    that runs it and returns the verified tree. Used by `sharded_init`, tests and
    the benchmark."""
    mesh, traced, _, shardings = plan(request)
    jitted = _jitted(mesh, traced, shardings)
    # The inputs (keys, sizes) are small: replicated on the mesh, from any device
    # or mesh they were made on.
    replicated = NamedSharding(mesh, PartitionSpec())
    inputs = [
        None
        if x is None
        else jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=_input_sharding(x, replicated)
        )
        for x in traced.inputs
    ]
    with jax.set_mesh(mesh):
        with _lowering.unrolled_threefry_on_cpu():
            lowered = jitted.trace(inputs).lower()
        compiled = lowered.compile()  # compile-time sharding checks run here

    def run() -> Any:
        args = [None if x is None else _replicate(x, replicated) for x in traced.inputs]
        with jax.set_mesh(mesh):
            arrays = compiled(args)
        tree = traced.rebuild(arrays)
        run_deferred(traced, arrays, tree)
        verify(tree, shardings, "sharded_init")
        return tree

    return compiled, run


def _jitted(mesh: Any, traced: Traced, shardings: list) -> Any:
    """`traced` jitted to return each leaf laid out as planned."""
    out_shardings = [s for s in shardings if s is not None]
    body: Callable = traced
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    if explicit:
        # XLA creates each parameter in shards only where it may choose the layout.
        body = jax.sharding.auto_axes(
            traced,
            axes=tuple(explicit),
            out_sharding=[_only_axes(s, explicit) for s in out_shardings],
        )
    return jax.jit(body, out_shardings=out_shardings)


def _traced_init(request: Request) -> Any:
    """`sharded_init` inside a trace (`jit`, `jax.eval_shape`): `fn`'s result laid
    out as planned, a part of the computation being traced (which decides what is
    created, and where); the mesh may be abstract. No check of the result is left
    to run: its layout is the planned one by construction."""
    mesh, traced, _, shardings = plan(request)
    arrays = _jitted(mesh, traced, shardings)(traced.inputs)
    return traced.rebuild(arrays)


def _spans_processes(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _input_sharding(x: Any, replicated: NamedSharding) -> Any:
    # A global array (spanning processes) keeps its own layout: no process holds
    # all of it to copy, and moving it would be a collective for nothing. So does
    # one already laid out on the mesh (the parameters of `opt.init(params)`):
    # replicating it would put a whole parameter on every device.
    return (
        x.sharding
        if _spans_processes(x) or _init_plan.on_mesh(x, replicated.mesh)
        else replicated
    )


def _replicate(x: Any, sharding: NamedSharding) -> Any:
    """`x` (the same value in every process) replicated over the whole mesh; a
    global array as it is."""
    if _spans_processes(x) or _init_plan.on_mesh(x, sharding.mesh):
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # Across processes: each contributes its copy, as JAX's multi-host API asks
    # (JAX cannot tell when the processes' copies differ).
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _replicate(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def _only_axes(sharding: NamedSharding, axes: frozenset) -> NamedSharding:
    # `auto_axes` reshards to its `out_sharding` on the caller's mesh, where only
    # Explicit axes may be named; `jit`'s `out_shardings` places the Auto ones.
    entries = [
        tuple(a for a in e if a in axes) for e in _spec.entries_of(sharding.spec)
    ]
    spec = PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in entries))
    return NamedSharding(sharding.mesh, spec)


def verify(tree: Any, shardings: list, what: str) -> None:
    """Every array leaf of `tree` is laid out as its sharding says (metadata only)."""
    if current_mode() == "off":
        return
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    wrong = []
    mesh = None
    for (path, leaf), want in zip(leaves_with_paths, shardings):
        if want is None:
            continue
        mesh = want.mesh
        got = getattr(leaf, "sharding", None)
        ndim = len(leaf.shape)
        if got is None or not got.is_equivalent_to(want, ndim):
            shown = (
                _spec.format_array(leaf.dtype, leaf.shape, _spec.entries_of(got.spec))
                if isinstance(got, NamedSharding)
                else f"{_spec.format_array(leaf.dtype, leaf.shape, ())} ({got})"
            )
            expected = _spec.format_array(
                leaf.dtype, leaf.shape, _spec.entries_of(want.spec)
            )
            wrong.append(
                f"  output{jax.tree_util.keystr(path)}: `{shown}`, not `{expected}`"
            )
    if wrong:
        message = (
            f"{what}: after init, {len(wrong)} leaf/leaves are not laid out as "
            f"annotated (mesh {_mesh.format_mesh(mesh)}):\n" + "\n".join(wrong)
        )
        if current_mode() == "warn":
            warnings.warn(message, ShardingWarning, stacklevel=3)
            return
        raise ShardingTypeCheckError(message)


@_per_call_step  # axis_rules=: the call runs under that table
def sharded_init(
    fn: Callable,
    *args: Any,
    mesh: Any = None,
    annotations: Any = None,
    rules: Optional[Mapping[str, Any]] = None,
    stacked: Optional[Mapping[str, Any]] = None,
    strict: bool = False,
    like: Any = None,
    axis_rules: Any = None,
    **kwargs: Any,
) -> Any:
    """Calls `fn(*args, **kwargs)`, creating every leaf already sharded as annotated.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jaxtyping_shard as jts
        from beartype import beartype
        from jax.sharding import AxisType, PartitionSpec as P
        from jaxtyping import Array, jaxtyped
        from jaxtyping_shard import Float

        @jaxtyped(typechecker=beartype)
        class Linear(eqx.Module):
            weight: Float[Array, "embed mlp", P(None, "model")]
            bias: Float[Array, "mlp@model"]

            def __init__(self, key):
                self.weight = jax.random.normal(key, (16, 32))
                self.bias = jax.numpy.zeros(32)

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        layer = jts.sharded_init(Linear, jax.random.key(0), mesh=mesh)
        assert layer.weight.sharding.spec == P(None, "model")
        ```

    `fn` is compiled once. Each parameter is created in shards: no device holds
    a whole sharded parameter, on `Explicit`, `Auto` and mixed meshes. The
    sharding checks of a `@jaxtyped` module's `__init__` run for real, when XLA
    compiles `fn`, and every leaf of the result is verified against its
    annotation afterwards. See [Sharded initialisation](sharded_init.md).

    **Arguments:**

    - `fn`: a module class or any function returning a pytree. Its array
        arguments (PRNG keys included) are traced; the others are static.
    - `*args`, `**kwargs`: passed to `fn`. Pass an argument named like an option
        below through `functools.partial`.
    - `mesh`: a `jax.sharding.Mesh`; omitted: the context mesh (`jax.set_mesh`),
        else that of the `like` tree's arrays (`opt.init(params)`: `params`').
        Inside a trace (`jit`, `jax.eval_shape`), an `AbstractMesh` will do: there
        `fn`'s result is laid out as planned as part of the traced computation
        (an input pipeline traced abstractly, for [`jaxtyping_shard.preflight`][]).
    - `annotations`, `rules`: as for [`jaxtyping_shard.shardings`][]: an
        annotation tree or type hint, and path rules, for leaves whose fields
        are not annotated (third-party modules).
    - `stacked`: `{pattern: n}` declares that the leaves matching the path
        pattern (the rules' syntax, e.g. `"blocks/**"`) have `n` extra leading
        dims before the ones their annotation describes (layers stacked with
        `eqx.filter_vmap`), replicated; `{pattern: ("pipe",)}` shards them.
    - `strict`: `False` (default): unannotated array leaves are replicated.
        `True`: they are an error.
    - `like`: a tree (the parameters) the result follows by the `like=` rule
        of [`jaxtyping_shard.check_tree`][] (an optimiser state's moments as
        the parameters, other leaves replicated). Omitted, with no `annotations`
        or `rules`: the first positional argument holding an array whose
        structure the result holds (`sharded_init(opt.init, params)`), or one
        placed array if the result declares no layout. `like=False`: never.
    - `axis_rules`: as for [`jaxtyping_shard.check_tree`][].

    **Returns:**

    The tree `fn` returns, its array leaves placed as annotated; non-array leaves
    and static fields as `fn` made them.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] before compiling, listing every
    leaf whose dims its mesh axes do not divide (with the padded size that
    would), that names an axis the mesh lacks, or whose rank contradicts its
    annotation. [`jaxtyping_shard.ShardingTypeCheckError`][] when a check in `fn`
    fails when XLA compiles it, or a leaf of the result is not laid out as
    annotated.
    """
    request = Request(
        fn, args, kwargs, mesh, annotations, rules, stacked, strict, like=like
    )
    if not compat.top_level():
        return _traced_init(request)
    _, run = compile_init(request)
    return run()


@_per_call_step  # axis_rules=: the call runs under that table
def abstract(
    fn: Callable,
    *args: Any,
    mesh: Any = None,
    annotations: Any = None,
    rules: Optional[Mapping[str, Any]] = None,
    stacked: Optional[Mapping[str, Any]] = None,
    strict: bool = False,
    like: Any = None,
    axis_rules: Any = None,
    **kwargs: Any,
) -> Any:
    """The tree `fn(*args, **kwargs)` would return, as `jax.ShapeDtypeStruct`s with
    the shardings their annotations ask for. Nothing is computed or allocated.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import jaxtyping_shard as jts
        from jax.sharding import AxisType, PartitionSpec as P

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Auto,) * 2)
        tree = jts.abstract(lambda: {"w": jnp.zeros((8, 4))}, mesh=mesh,
                            annotations={"w": P("data", None)})
        assert tree["w"].sharding.spec == P("data", None)
        ```

    Unlike `jax.eval_shape`, this reports shardings on `Auto` meshes too
    (jax#19656): the targets that restoring a checkpoint, or
    `jax.make_array_from_process_local_data`, need. `mesh` may be a
    `jax.sharding.AbstractMesh` of any size (no devices needed): the inputs of
    [`jaxtyping_shard.preflight`][] on the production mesh.

    **Arguments:** as for [`jaxtyping_shard.sharded_init`][].

    **Returns:**

    The tree with a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for every
    array leaf (replicated where unannotated), the other leaves as they are.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] as `sharded_init` does before
    compiling.
    """
    request = Request(
        fn, args, kwargs, mesh, annotations, rules, stacked, strict, "abstract", like
    )
    _, _, tree, shardings = plan(request)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = [
        leaf
        if sharding is None
        else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        for leaf, sharding in zip(leaves, shardings)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)
