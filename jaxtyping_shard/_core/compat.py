"""Everything that differs between the supported JAX releases, in one place.

Each function says which releases take which branch, and why. The supported range
and what differs across it are listed in docs/compat.md; CI tests both ends.
"""

import contextlib
import functools
import importlib
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
from jax._src.array import ArrayImpl as _ArrayImpl  # the eager hot path
from jax._src.lib.mlir import ir  # MLIR bindings: `walk_custom_calls`
from jax._src.lib.mlir.dialects import hlo
from jax.sharding import AxisType


# JAX-private state read below, each in one function that says why; a JAX
# without one takes that function's fallback.
try:
    from jax._src.config import _check_vma
except ImportError:  # pragma: no cover - a JAX without it
    _check_vma = None
try:
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a JAX without it
    _trace_state_clean = None
try:
    from jax._src import config as _jax_config
except ImportError:  # pragma: no cover - a JAX without it
    _jax_config = None
try:
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - a JAX without it
    _source_info_util = None


def _mesh_states() -> Any:
    """The module holding the two thread-local states `jax.set_mesh` swaps
    (`abstract_mesh_context_manager`, `device_context`; see `mesh_scope`):
    `jax._src.mesh` in JAX 0.12, `jax._src.config` in 0.8 and 0.10. `None` if
    neither has them."""
    for name in ("jax._src.mesh", "jax._src.config"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover
            continue
        if hasattr(module, "abstract_mesh_context_manager") and hasattr(
            module, "device_context"
        ):
            return module
    return None  # pragma: no cover - a JAX without them


_jax_config = _mesh_states()
try:
    from jax._src.mesh import empty_concrete_mesh as _no_concrete_mesh
except ImportError:  # pragma: no cover - a JAX without it
    _no_concrete_mesh = None


def _version(text: str) -> tuple[int, ...]:
    """`"0.12.0.1"` -> `(0, 12, 0, 1)`; a suffix such as `rc1` or `.dev` is dropped."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(p) for p in match.group().split(".")) if match else ()


JAX_VERSION: tuple[int, ...] = _version(jax.__version__)


def varying_axes(aval: Any) -> frozenset[str]:
    """The manual mesh axes a value inside `shard_map` varies over (`{V:data}`).

    JAX 0.10 moved them from `aval.vma` to `aval.manual_axis_type.varying`.
    """
    axis_type = getattr(aval, "manual_axis_type", None)
    if axis_type is not None:  # JAX >= 0.10
        return frozenset(axis_type.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.8, 0.9


def vma_tracked() -> bool:
    """Whether JAX tracks varying axes here: `shard_map(..., check_vma=False)` turns
    it off, and then every value looks invariant.

    Read from JAX's private config state (no public API says it, in any supported
    release); if it cannot be read, assume tracked.
    """
    if _check_vma is None:  # pragma: no cover - a JAX without it
        return True
    return bool(_check_vma.value)


def legacy_mesh_context_warns() -> bool:
    """Whether `with mesh:` emits a `DeprecationWarning` (JAX >= 0.10.1)."""
    return JAX_VERSION >= (0, 10, 1)


def make_mesh_default_axis_type() -> Any:
    """The axis type `jax.make_mesh` gives when `axis_types` is not passed.

    `Auto` in JAX 0.8 (which warns that the default will change), `Explicit` from
    0.9. The two are checked at different times (trace time vs
    compile time), so this library's examples and tests always pass `axis_types`.
    """
    return AxisType.Explicit if JAX_VERSION >= (0, 9) else AxisType.Auto


def set_user_context_global(context: Any, value: Any) -> None:
    """Sets the process-wide value of a `jax.make_user_context` context.

    `UserConfig.set_global` is public from JAX 0.10.1; before, the same method is
    reached on the JAX-private `Config` object behind it (`_obj`).
    """
    set_global = getattr(context, "set_global", None)
    if set_global is not None:  # JAX >= 0.10.1
        set_global(value)
    else:
        context._obj.set_global(value)


def get_user_context_global(context: Any) -> Any:
    """The process-wide value of a `jax.make_user_context` context.

    `UserConfig.get_global` is public from JAX 0.10.1; before, the same method is
    reached on the JAX-private `Config` object behind it (`_obj`).
    """
    get_global = getattr(context, "get_global", None)
    if get_global is not None:  # JAX >= 0.10.1
        return get_global()
    return context._obj.get_global()


def threefry_module() -> Any:
    """The private module holding `threefry2x32_p` and its lowering rules.

    `jax._src.random.threefry2x32` in newer JAX (0.10 has it); `jax._src.prng` in
    older releases (0.8). Used only by `_lowering`, which explains why.
    """
    try:
        return importlib.import_module("jax._src.random.threefry2x32")
    except ImportError:  # older JAX
        return importlib.import_module("jax._src.prng")


def jit_handles_empty_explicit_arrays() -> bool:
    """Whether `jax.jit` accepts an array with no elements sharded over Explicit
    mesh axes: JAX 0.8 and 0.9 fail their own assertion ("Unexpected XLA sharding
    override"), with or without this library; fixed by 0.10.2 (0.10.0 and 0.10.1
    untested)."""
    return JAX_VERSION >= (0, 10)


def vmap_spmd_axis_name_on_explicit_axes() -> bool:
    """Whether `jax.vmap(..., spmd_axis_name=a)` accepts inputs whose batch dim is
    sharded over an Explicit axis `a`: JAX 0.8 refuses ("Only one of
    spmd_axis_name or arrays sharded on `Explicit` mesh axis type is allowed")."""
    return JAX_VERSION >= (0, 9)


def top_level() -> bool:
    """Whether no trace (`jit`, `grad`, `vmap`, ...) is under way in this thread.

    JAX's private `core.trace_state_clean`, in every supported release (0.12 also
    counts an empty trace context as clean). Without it, `False`: callers then
    take their general path, which handles both cases."""
    return _trace_state_clean is not None and _trace_state_clean()


def jit_disabled() -> bool:
    """Whether `jax.disable_jit()` is in force here (its thread-local value, else
    the global one): the public `jax.config.jax_disable_jit`, which the type
    stubs of `jax.config` do not declare, in every supported release."""
    return bool(jax.config.jax_disable_jit)  # pyright: ignore[reportAttributeAccessIssue]


def walk_custom_calls(operation: Any, callback: Any) -> None:
    """Calls `callback(op)` on the custom calls under an MLIR `operation`, in order
    (and on other ops too where the bindings cannot filter: `callback` must check).

    `Operation.walk` takes `op_class` (filtered in C++) in the MLIR bindings of
    jaxlib 0.10 and 0.12; those of 0.8 pass every op to the callback.
    """
    if "op_class" in (ir.Operation.walk.__doc__ or ""):
        operation.walk(callback, ir.WalkOrder.PRE_ORDER, op_class=hlo.CustomCallOp)
    else:
        operation.walk(callback, ir.WalkOrder.PRE_ORDER)


def hlo_stack_frames_usable() -> bool:
    """Whether a compiled module's stack-frame tables match the `stack_frame_id`s
    of its op metadata: from JAX 0.9. JAX 0.8 writes ids that point elsewhere in
    its tables, and inline the one frame it takes for the user's."""
    return JAX_VERSION >= (0, 9)


def without_persistent_cache() -> Any:
    """A context in which a compile does not use JAX's persistent compilation
    cache (which drops XLA's dump options from its key, so a step it holds
    would be answered without the dump `layouts` reads). JAX's private
    `config.enable_compilation_cache` state, thread-local; JAX 0.12 decides
    once per process whether to use the cache, and there it does nothing
    (`layouts` then says that no module was written)."""
    try:
        return _jax_config.enable_compilation_cache(False)  # type: ignore[union-attr]
    except (AttributeError, TypeError):  # pragma: no cover - a JAX without it
        return contextlib.nullcontext()


def hide_from_jax_source_info(directory: str) -> None:
    """Makes JAX's guess of an op's user frame skip the files under `directory`.

    Only where a compiled module's only reliable source is that guess (JAX 0.8,
    see `hlo_stack_frames_usable`): there, an op made inside this package (an
    all-gather by `jts.reshard`) would otherwise be placed in this package, not
    at the user's line. Later releases keep every frame, this package's
    included (they tell an annotated function by its checker's frames). Through
    JAX's private `source_info_util.register_exclusion`, as JAX excludes its own
    files; without it, nothing is hidden.
    """
    if not hlo_stack_frames_usable() and _source_info_util is not None:
        _source_info_util.register_exclusion(directory)


hide_from_jax_source_info(os.path.dirname(os.path.dirname(__file__)) + os.sep)


@contextlib.contextmanager
def mesh_scope(mesh: Any) -> Iterator[None]:
    """`mesh` as the context mesh in this block: `jax.set_mesh` for a `Mesh`; an
    `AbstractMesh` (which `jax.set_mesh` refuses) as the context's abstract mesh
    with no concrete one, which is what `jax.set_mesh` itself sets for a `Mesh`.

    The public `jax.sharding.use_abstract_mesh` refuses a mesh of another size
    than the one in context (`jax.set_mesh(small)` around a preflight of the
    production mesh) and leaves the concrete mesh of `jax.set_mesh` in place; so
    the two JAX-private thread-local states that `jax.set_mesh` swaps are swapped
    here (the same names in every supported release, in `jax._src.config` up to
    0.10 and `jax._src.mesh` in 0.12: `_mesh_states`). Without them, the public
    `use_abstract_mesh`.
    """
    if isinstance(mesh, jax.sharding.Mesh):
        with jax.set_mesh(mesh):
            yield
        return
    if _jax_config is None or _no_concrete_mesh is None:  # pragma: no cover
        with jax.sharding.use_abstract_mesh(mesh):
            yield
        return
    previous = _jax_config.abstract_mesh_context_manager.swap_local(mesh)
    concrete = _jax_config.device_context.swap_local(_no_concrete_mesh)
    try:
        yield
    finally:
        _jax_config.device_context.set_local(concrete)
        _jax_config.abstract_mesh_context_manager.set_local(previous)


_FRESH_VALUES_HAVE_A_MESH: list[bool] = []


def fresh_values_have_a_mesh() -> bool:
    """Whether a value made inside a trace without a layout (`jnp.zeros` under an
    Explicit mesh) has the context mesh in its type, so that `jax.eval_shape`
    reports it replicated on the mesh: JAX 0.10 (0.9 untested), not 0.8, whose
    type for it names no mesh (and `eval_shape` no sharding).

    Found by tracing once (a 2-device `AbstractMesh`, nothing compiled)."""
    if not _FRESH_VALUES_HAVE_A_MESH:
        mesh = jax.sharding.AbstractMesh((2,), ("x",), axis_types=(AxisType.Explicit,))
        with mesh_scope(mesh):
            out = jax.eval_shape(lambda: jax.numpy.zeros((2,)))
        _FRESH_VALUES_HAVE_A_MESH.append(out.sharding is not None)
    return _FRESH_VALUES_HAVE_A_MESH[0]


class _NoValueHasThisClass:
    pass


# JAX's concrete array class, whose sharding the eager check's hot path reads
# straight from `_sharding`: `jax.Array.sharding` is a Python property over it,
# at 4x the cost (180 ns against 40). A JAX without it takes the general path.
ARRAY_IMPL: type = (
    _ArrayImpl if hasattr(_ArrayImpl, "_sharding") else _NoValueHasThisClass
)


@functools.cache
def pending_axes_missing(kinds: tuple[str, ...]) -> str:
    """Which of `kinds` ("unreduced", "reduced") the installed JAX's
    `PartitionSpec` lacks, with the release that has them; "" when it has all.

    Every supported release (0.8.1 and newer) has both; an older JAX, whose
    `PartitionSpec` takes no such keyword, gets this message rather than a
    `TypeError` from inside jaxtyping_shard.
    """
    lacking = []
    for kind in kinds:
        try:
            ok = hasattr(
                jax.sharding.PartitionSpec(**{kind: frozenset({"_probe"})}), kind
            )
        except TypeError:
            ok = False
        if not ok:
            lacking.append(kind)
    if not lacking:
        return ""
    return (
        f"the installed JAX {jax.__version__} has no `PartitionSpec("
        f"{'=..., '.join(lacking)}=...)`; JAX 0.8.1 (jaxtyping_shard's floor) and "
        "newer have both `unreduced=` and `reduced=`. Upgrade JAX, or annotate the "
        "layout without them."
    )


def no_collectives_state() -> Any:
    """JAX's `jax.sharding.no_collectives` (a config state, a context manager
    when called with a set of axes): from JAX 0.12, which raises at trace time
    at an op that would communicate over one of them on Explicit axes. None
    before."""
    return getattr(jax.sharding, "no_collectives", None)


def is_forbidden_collective(error: BaseException) -> bool:
    """Whether `error` is JAX's `ForbiddenCollectiveError` (JAX 0.12: what
    `no_collectives` raises). By class name: JAX does not export the class."""
    return any(
        t.__name__ == "ForbiddenCollectiveError" and t.__module__.startswith("jax")
        for t in type(error).__mro__
    )
