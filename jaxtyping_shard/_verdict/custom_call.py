"""The compile-time check in XLA's program: a custom call that a program keys the
same in every process, so that JAX's persistent compilation cache hits.

JAX's own `inspect_array_sharding` lowers to XLA's `InspectSharding` custom call,
whose `backend_config` is a pointer to a Python callback: other bytes in every
process, so another persistent-cache key (the key hashes the module) and a
recompile at every restart. Here the check is a custom call of our own,
`jts_check_sharding`, with a partitioner registered with XLA as JAX's
`custom_partitioning` registers its own, and a `backend_config` that names the
check by what the program is, not by where it lives in memory:

- lowering emits one custom call per check, keyed `jts-pending:<n>:<index>`:
  unique in this process, so that a module that never gets its final keys is
  still checked exactly (only never cached);
- when JAX has lowered the module (the end of its lowering event, in the
  lowering thread, before anything can compile it), the checks of each block are
  merged into one custom call at the block's end, keyed `jts:<digest>:<block>`;
  the digest hashes the module without its locations and the verdict's inputs of
  every check, so one program gives the same bytes in every process and a key
  names one program. One call per block, however many checks: XLA parses a
  small module (a new MLIR context) for each call it partitions this way, about
  3 ms a call, and a call's own cost grows with its operands in proportion
  (figures 5 and 16 of benchmarks/);
- the call has operands and no results, and no sharding rule: nothing uses it,
  so XLA's propagation has nothing to carry through it and decides its operands'
  layouts as it would without it (a call with results needed a rule, which cost
  Shardy a factor per dim, and its results were laid out again, dead code XLA
  then removed);
- XLA's partitioner calls `_partition` with the operands' shardings (from its own
  threads); the key finds the checks (of every live module of that program) and
  hands each its sharding. The call becomes nothing: none of it is left in the
  compiled program.
"""

import functools
import hashlib
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np

# JAX-private names, each used in one function below that says why.
from jax._src import sharding_impls, xla_bridge
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from .._core import compat as _compat


CALL_TARGET = "jts_check_sharding"
_PENDING = "jts-pending"
_FINAL = "jts"


class Maximal:
    """XLA put the value on one device (e.g. a `pure_callback` result)."""

    def __init__(self, hlo: str):
        self.hlo = hlo


class Untileable:
    """XLA tiled the value in a way no PartitionSpec on the mesh can write."""

    def __init__(self, hlo: str, reason: str):
        self.hlo = hlo
        self.reason = reason


def as_sharding(hlo_sharding: Any, mesh: Any) -> Any:
    """What XLA chose, for the verdict: a `NamedSharding` on `mesh`, else a
    `Maximal` or an `Untileable`. JAX's own `inspect_array_sharding` converts with
    the same private `parse_flatten_op_sharding`, and fails (`Unhandled OpSharding
    type`, `IndivisibleError`) where XLA chose a layout the mesh cannot write."""
    if hlo_sharding.is_manual():
        spec = PartitionSpec()
    elif hlo_sharding.is_maximal() and not hlo_sharding.is_replicated():
        return Maximal(str(hlo_sharding))
    else:
        try:
            spec = sharding_impls.parse_flatten_op_sharding(hlo_sharding, mesh)[0]
        except Exception as error:  # IndivisibleError, or a kind JAX cannot map
            return Untileable(str(hlo_sharding), str(error))
    return NamedSharding(mesh, spec)


# XLA reports the same few shardings for most checks of a program.
_as_sharding = functools.lru_cache(maxsize=1024)(as_sharding)


class Module:
    """The checks of one lowered module: for each, the mesh its sharding is read
    on; reports go to `target.report(index, sharding)`."""

    _tokens = itertools.count()

    def __init__(self, target: Any):
        self.ir_module: Optional[Any] = None  # until its keys are final
        self.target = target
        self.token = next(self._tokens)
        self.meshes: dict[int, Any] = {}
        self.keys: list[str] = []

    def report(self, index: int, hlo_sharding: Any) -> None:
        self.target.report(index, _as_sharding(hlo_sharding, self.meshes[index]))


_MODULE_KEY = object()


def emit(ctx: Any, value: Any, target: Any, index: int, value_mesh: Any) -> None:
    """Lowers check `index` of `target` on `value` (a primitive's lowering rule)."""
    module_context = ctx.module_context
    cache = module_context.cached_primitive_lowerings
    # One module, one axis context: its mesh is found once per value mesh.
    mesh = cache.get((_MODULE_KEY, value_mesh))
    if mesh is None:
        mesh = _compile_mesh(module_context.axis_context, value_mesh)
        cache[(_MODULE_KEY, value_mesh)] = mesh
    if mesh.size == 1:
        # One device: nothing for XLA to decide; the verdict is known now.
        target.report(index, NamedSharding(mesh, PartitionSpec()))
        return
    module = cache.get(_MODULE_KEY)
    if module is None:
        module = cache[_MODULE_KEY] = Module(target)
        module_context.add_keepalive(module)  # the partitioner reads it while compiling
        if _lowering.stack:  # JAX announced this lowering: final keys at its end
            module.ir_module = module_context.module
            _lowering.stack[-1].append(module)
        # One entry for all its pending calls: the index is the key's last part.
        _register(f"{_PENDING}:{module.token}", module, ())
    module.meshes[index] = mesh
    _custom_call([value], f"{_PENDING}:{module.token}:{index}")


def _compile_mesh(axis_context: Any, value_mesh: Any) -> Any:
    """The concrete mesh the compile's HLO shardings refer to: the context mesh
    (else the value's) over the compile's devices. Read from JAX's private axis
    contexts, as its own `inspect_sharding` lowering does."""
    if isinstance(axis_context, sharding_impls.ShardingContext):
        devices = axis_context.device_assignment
        abstract = axis_context.abstract_mesh
        if abstract is None or abstract.empty:
            abstract = value_mesh
        if devices is None or abstract is None or abstract.size != len(devices):
            raise AssertionError(
                f"jaxtyping_shard: no mesh of {len(devices or ())} devices to check "
                "shardings on; please report this at the project's issue tracker"
            )
        return _mesh_over(tuple(devices), abstract)
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return axis_context.mesh
    raise NotImplementedError(type(axis_context))


@functools.lru_cache(maxsize=64)
def _mesh_over(devices: tuple, abstract: Any) -> Any:
    return jax.sharding.Mesh(
        np.array(devices).reshape(abstract.axis_sizes),
        abstract.axis_names,
        axis_types=abstract.axis_types,
    )


def _custom_call(operands: list, key: str, ip: Any = None) -> Any:
    """One `jts_check_sharding` call on `operands`, with no results (see the
    module's docstring)."""
    return hlo.CustomCallOp(
        [],
        operands,
        call_target_name=ir.StringAttr.get(CALL_TARGET),
        has_side_effect=ir.BoolAttr.get(True),  # kept although nothing uses it
        api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]),
        backend_config=ir.StringAttr.get(key),
        operand_layouts=None,
        result_layouts=None,
        ip=ip,
    )


# The registry: backend_config -> the modules (weakly) and check indices it names.
_registry: dict[str, list[tuple[Any, tuple[int, ...]]]] = {}
_registry_lock = threading.Lock()


def _register(key: str, module: Module, indices: tuple[int, ...]) -> None:
    with _registry_lock:
        live = [e for e in _registry.get(key, ()) if e[0]() is not None]
        _registry[key] = [*live, (weakref.ref(module), indices)]
        module.keys.append(key)
        if len(_registry) > 4096:  # modules gone: drop their keys
            for k in [
                k for k, es in _registry.items() if all(r() is None for r, _ in es)
            ]:
                del _registry[k]


def _unregister(keys: list[str], module: Module) -> None:
    with _registry_lock:
        for key in keys:
            live = [e for e in _registry.get(key, ()) if e[0]() not in (None, module)]
            if live:
                _registry[key] = live
            else:
                _registry.pop(key, None)


def _lookup(key: str) -> list[tuple[Module, tuple[int, ...]]]:
    with _registry_lock:
        entries = list(_registry.get(key, ()))
    return [(m, indices) for ref, indices in entries if (m := ref()) is not None]


class _Lowering(threading.local):
    # One list per module being lowered in this thread (innermost last): the
    # `Module`s created while it is lowered, finalised when its lowering ends.
    stack: Optional[list] = None


_lowering = _Lowering()
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def on_lowering_start() -> None:
    """JAX starts lowering a module in this thread (its lowering event)."""
    if _lowering.stack is None:
        _lowering.stack = []
    _lowering.stack.append([])


def on_lowering_end() -> None:
    """JAX has lowered that module: its checks get their final keys."""
    if not _lowering.stack:
        return
    modules = _lowering.stack.pop()
    if sys.exc_info()[0] is not None:
        return  # the lowering failed: the module is thrown away
    for module in modules:
        finalize(module)


def finalize(module: Module) -> None:
    """Merges the module's checks, one call per block, under keys made of what the
    program is (see the module's docstring)."""
    ir_module, module.ir_module = module.ir_module, None
    if ir_module is None:
        return
    prefix = f"{_PENDING}:{module.token}:"
    blocks: list[tuple[Any, list]] = []

    start = len(prefix)

    def visit(op: Any) -> Any:
        op = op.operation  # an OpView where the walk filters by class
        attributes = op.attributes
        # The prefix is this module's own: no other call's config starts so.
        if "backend_config" in attributes:
            key = ir.StringAttr(attributes["backend_config"]).value
            if key.startswith(prefix):
                block = op.block
                for seen, ops in blocks:
                    if seen == block:
                        ops.append((op, int(key[start:])))
                        break
                else:
                    blocks.append((block, [(op, int(key[start:]))]))
        return ir.WalkResult.ADVANCE

    _compat.walk_custom_calls(ir_module.operation, visit)
    if not blocks:
        return
    merged = []
    with ir_module.context, ir.Location.unknown():
        for number, (block, ops) in enumerate(blocks):
            at_end = ir.InsertionPoint.at_block_terminator(block)
            operands = [op.operands[0] for op, _ in ops]
            call = _custom_call(operands, f"{_FINAL}:?:{number}", ip=at_end)
            for op, _ in ops:
                op.erase()
            merged.append((call, tuple(index for _, index in ops)))
        digest = hashlib.sha256(
            ir_module.operation.get_asm(enable_debug_info=False).encode()
        )
        fingerprint = module.target.fingerprint
        for _, indices in merged:
            digest.update("".join(map(fingerprint, indices)).encode())
        name = digest.hexdigest()[:32]
        pending, module.keys = module.keys, []
        for number, (call, indices) in enumerate(merged):
            key = f"{_FINAL}:{name}:{number}"
            call.attributes["backend_config"] = ir.StringAttr.get(key)
            _register(key, module, indices)
    _unregister(pending, module)


def _partition(arg_shapes, arg_shardings, result_shape, result_sharding, config):
    """XLA's SPMD partitioner, at a `jts_check_sharding` call: hands each check its
    operand's sharding, and gives XLA the call's lowering: nothing, the operands
    as they are (no reshard).

    Under a final key, several live modules may hold the same program (two `jit`s of
    one function): the last lowered is the one to compile (a `Lowered` compiled
    later than another of the same program gets the same verdict from it).
    """
    key = bytes(config).decode()
    if key.startswith(_PENDING):  # `jts-pending:<n>:<index>`, one check
        module_key, _, index = key.rpartition(":")
        entries = [(m, (int(index),)) for m, _ in _lookup(module_key)]
    else:
        entries = _lookup(key)
    if not entries:
        raise RuntimeError(
            f"jaxtyping_shard: no sharding check is registered under {key!r} in this "
            "process; please report this at the project's issue tracker"
        )
    module, indices = entries[-1]
    shardings = [
        s if s is not None else sharding_impls.replicated_hlo_sharding
        for s in arg_shardings
    ]
    for hlo_sharding, index in zip(shardings, indices):
        module.report(index, hlo_sharding)
    return _NOTHING, shardings, _no_results(result_shape)


# The call's partitioned form: a module of no arguments that computes nothing.
_NOTHING = b"module @jts_check { func.func public @main() { return } }"


def _no_results(shape: Any) -> Any:
    """The sharding of the call's (empty) tuple of results."""
    return xc.HloSharding.tuple_sharding(shape, [])


def _infer(arg_shapes, arg_shardings, result_shape, config):
    # GSPMD, forwards: there are no results to lay out.
    return _no_results(result_shape)


def _propagate_user(sharding, shape, config):
    # GSPMD, backwards: the call has no results, so no users; keep what it asks.
    return sharding


def _register_partitioner(register: Callable[..., None], **extra: Any) -> None:
    register(
        name=CALL_TARGET,
        prop_user_sharding=_propagate_user,
        partition=_partition,
        infer_sharding_from_operands=_infer,
        can_side_effecting_have_replicated_sharding=True,
        **extra,
    )


# With XLA in this process, and with every PJRT plugin (GPU, TPU) as JAX finds
# them: the private `xla_bridge.register_plugin_callbacks`, as JAX's own
# `custom_partitioning` does.
_register_partitioner(xc.register_custom_call_partitioner)
xla_bridge.register_plugin_callbacks(
    functools.partial(_register_partitioner, xc.register_custom_call_partitioner)
)
