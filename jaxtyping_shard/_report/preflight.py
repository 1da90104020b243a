"""`preflight`: a step traced on the production mesh, every check, the bytes.

The step goes through `jts.jit`'s own machinery (`_drivers/jit`): its arguments
are placed as their annotations ask (`derive`, `arguments`: every leaf of every
tree, field annotations, rules), their boundary is checked (`boundary`), and it
is traced on the mesh, where every annotation inside it is checked as in a real
run. Nothing runs and nothing is allocated: the arguments are made abstract
first (`jax.ShapeDtypeStruct`s, a concrete array's layout carried over by its
spec), and a `jax.sharding.AbstractMesh` of any size has no devices at all.

Every failure of the trace is collected (`_core.failures.collecting`: the check
passes, so the trace goes on and finds the next) and all are raised at the end
as one error, by path and line. Checks that only XLA's partitioner can decide
(mesh axes of type `Auto`) are counted, and run when the step is compiled on a
real `check_mesh` with the same axis names (forced CPU devices will do).
"""

from typing import Any, Optional

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .._core import compat, failures as _failures, mesh as _mesh
from .._core.errors import ShardingTypeCheckError
from .._drivers.jit import boundary as _boundary, derive as _derive
from .._layout import bridge as _bridge
from .._layout.spec import has_sharding
from .._rules.scope import per_call_step as _per_call_step
from .._trees import (
    like_hint as _like_hint,
    reading as _reading,
    signature as _signature,
    walk as _tree,
)
from .._trees.signature import function_name
from .._verdict import auto as _auto
from .._verdict.compare import FIX
from . import cpu_mesh as _cpu_mesh, limits as _limits
from .abstract_args import abstract, has_arrays, is_array, unplaced
from .memory import Checks, leaf_bytes, LeafBytes, PreflightReport


@_per_call_step  # axis_rules=: the call runs under that table
def preflight(
    fn: Any,
    *args: Any,
    mesh: Any = None,
    hbm_bytes: Optional[int] = None,
    check_mesh: Any = None,
    axis_rules: Any = None,
    max_replicated: Any = None,
    **kwargs: Any,
) -> PreflightReport:
    """Checks a step on the production mesh and counts its bytes per device,
    without devices: `fn(*args, **kwargs)` is traced, never run.

    !!! Example

        ```python
        import jax
        from jax.sharding import AbstractMesh, AxisType
        from jaxtyping import Array
        import jaxtyping_shard as jts
        from jaxtyping_shard import Float

        Out = Float[Array, "batch@data mlp@model"]

        @jts.jit(in_shardings="annotations", out_shardings="annotations")
        def step(w: Float[Array, "embed mlp@model"],
                 x: Float[Array, "batch@data embed"]) -> Out:
            return x @ w

        pod = AbstractMesh((512, 8), ("data", "model"),
                           axis_types=(AxisType.Explicit,) * 2)
        report = jts.preflight(step, jax.ShapeDtypeStruct((4096, 16384), "float32"),
                               jax.ShapeDtypeStruct((1024, 4096), "float32"),
                               mesh=pod, hbm_bytes=16 * 2**30)
        print(report)
        ```

    Everything the library checks in a real run on that mesh is checked: every
    annotated leaf of the arguments (placed as their annotations ask, as
    `jts.jit(in_shardings="annotations")` places them; one given with another
    layout is a mismatch), the result (`jts.jit`'s boundary checks, field
    annotations, `Like`, stacked layers: what `jts.jit` does), every annotation
    checked inside the step (`jaxtyped` functions, `check_tree`, `jts.reshard`),
    and the rules in force (`jts.axis_rules`). The trace goes on past each
    mismatch, so one error lists them all. See [Preflight](preflight.md).

    On `Explicit` mesh axes every check runs at trace time, so all of them run.
    Checks of values on `Auto` axes need XLA's partitioner: they run when the
    step is compiled on `check_mesh`, and are counted as not checked otherwise.

    **Arguments:**

    - `fn`: the step: a function, a `jax.jit` or `jts.jit` of one. Its arguments
        without array leaves are static (a `jts.jit` keeps its own settings).
    - `*args`, `**kwargs`: the step's arguments: `jax.ShapeDtypeStruct` trees
        (from [`jaxtyping_shard.abstract`][], `jax.eval_shape`), or concrete
        arrays, whose data is never read: each counts as its shape, dtype and
        layout (its `PartitionSpec`, carried over to `mesh`). A leaf with no
        sharding is placed as its annotation asks. Pass an argument named like an
        option below through `functools.partial`.
    - `mesh`: a `jax.sharding.AbstractMesh` of any size (`AbstractMesh((512,
        8), ("data", "model"), axis_types=...)`: 4,096 devices on a laptop), or a
        `Mesh`. Omitted: the context mesh (`jax.set_mesh`).
    - `hbm_bytes`: a budget per device. When the arguments, results and
        temporaries (where known: `check_mesh="cpu"`, a concrete Auto `mesh`)
        take more, preflight fails naming the largest of them.
    - `check_mesh`: a concrete `Mesh` with `mesh`'s axis names (e.g. 4 x 2
        forced CPU devices), on which the step is also compiled (never run), so
        that the checks on `Auto` axes run; or `"cpu"`: a real mesh of `mesh`'s
        shape, names and types made of forced CPU devices in a child process
        (beyond 2,048 devices, one process's limit, the mesh folded: its largest
        axis divided until it fits, `report.check_mesh_method == "folded"`),
        where the step is compiled, so that every check
        XLA decides runs at the real axis sizes, and `report.temporary_bytes`,
        `.temporaries` (by line) and `.collectives` come from that compile. The
        step must be importable there (see [Preflight](preflight.md)). Omitted:
        `mesh` itself if it is concrete, else none.
    - `max_replicated`: the most the leaves whole on every device may take per
        device: a float is a fraction of the bytes per device (`0.02`), an int
        a number of bytes. Over it, preflight fails naming the largest.
    - `axis_rules`: as for [`jaxtyping_shard.check_tree`][].

    **Returns:**

    A `PreflightReport`: printed, a table of bytes per device by argument, by
    top level of each tree, the largest leaves and the replicated ones, and what
    was and was not checked; as data, `.leaves`, `.argument_bytes`,
    `.output_bytes`, `.total_bytes`, `.by_argument()`, `.by_top_level()`,
    `.largest(n)`, `.replicated`, `.checks`, `.as_dict()`; and, when the step
    was compiled on `mesh` itself (concrete, or `check_mesh="cpu"`),
    `.xla_memory`, `.temporary_bytes`, `.peak_bytes`, `.temporaries` (and with
    `check_mesh="cpu"`, `.check_mesh_method`: `"one process"` or `"folded"`).

    **Raises:**

    [`jaxtyping_shard.ShardingTypeCheckError`][], one for all: every mismatch by
    path and line, and the budget exceeded (its `.report` attribute holds the
    report). [`jaxtyping_shard.ShardingAnnotationError`][] for an annotation
    that cannot be laid out on `mesh` (a name with no rule, a dim its mesh axes
    do not divide: all such leaves in one error).
    """
    mesh = _target_mesh(mesh)
    check_mesh = _cpu_mesh.check_mesh_of(check_mesh, mesh)
    hbm_bytes = _limits.hbm_budget(hbm_bytes)
    max_replicated = _limits.replicated_budget(max_replicated)
    if not compat.top_level():
        raise ValueError("jts.preflight traces its step itself: call it outside jit.")
    jitted = _annotated(fn, args, kwargs)
    name = function_name(fn)
    compiled_on = xla_memory = child = None
    with _failures.collecting() as found:
        try:
            traced, placed, scheduled = _trace(jitted, args, kwargs, mesh)
            outputs = traced.out_info
            if check_mesh == "cpu":  # the production mesh, real, in a child
                child = _cpu_mesh.compile_in_child(fn, args, kwargs, mesh)
                _cpu_mesh.add_findings(found, child)
                outputs = _cpu_mesh.outputs(outputs, child, mesh)
                compiled_on, xla_memory = _cpu_mesh.describe(mesh), child.memory
            elif scheduled and check_mesh is not None:
                compiled = _compile(jitted, args, kwargs, check_mesh)
                compiled_on = _mesh.format_mesh(check_mesh)
                if check_mesh is mesh:  # what XLA chose for unannotated results
                    outputs = compiled.out_info
                    xla_memory = compiled.memory_analysis()
        except Exception as error:
            if not found:
                raise
            # A check let through (to find the next) may leave a value JAX itself
            # refuses further on: the mismatches found first are the cause.
            head = _head(name, mesh)
            stopped = f"The trace then stopped: {type(error).__name__}: {error}"
            raise ShardingTypeCheckError(
                "\n".join([*_mismatches(head, found), stopped])
            ) from error
    given = (args, kwargs)
    report = _report(name, jitted, placed, given, outputs, mesh, scheduled, compiled_on)
    report.hbm_bytes, report.xla_memory = hbm_bytes, xla_memory
    report.max_replicated = max_replicated
    if child is not None:
        report.check_mesh_method = _cpu_mesh.method(mesh)
        report.temporaries = child.temporaries
        report.collectives = _cpu_mesh.collectives_of(child, name, mesh)
    over = _limits.over_lines(_head(name, mesh), report)
    if found or over:
        head = _head(name, mesh)
        lines = _mismatches(head, found) if found else []
        lines += over
        error = ShardingTypeCheckError("\n".join(lines))
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


def _target_mesh(mesh: Any) -> Any:
    mesh = _bridge.resolve_mesh(mesh, "preflight")
    if not isinstance(mesh, (Mesh, AbstractMesh)) or mesh.empty:
        raise ValueError(
            f"preflight needs a `jax.sharding.AbstractMesh` or `Mesh`, not {mesh!r}."
        )
    return mesh


def _annotated(fn: Any, args: tuple, kwargs: dict) -> _derive.AnnotatedJit:
    """`fn` as `jts.jit(in_shardings="annotations", ...)` would run it."""
    if isinstance(fn, _derive.AnnotatedJit):
        return fn.deriving_inputs()
    pure = getattr(fn, "_jts_pure", None)
    if callable(pure):
        # `jts.nnx_jit`: its step as a pure function, which returns the graph
        # nodes it updated in place (checked inside, and counted as outputs).
        fn = pure()
    while callable(getattr(fn, "lower", None)) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__  # a `jax.jit` (or `jts.jit`) object: its function
    if not getattr(fn, "_jts_boundary", False):
        fn = _boundary.checked(fn)
    static_nums = [i for i, a in enumerate(args) if not has_arrays(a)]
    static_names = [k for k, v in kwargs.items() if not has_arrays(v)]
    options: dict[str, Any] = {
        "in_shardings": _derive.ANNOTATIONS,
        "out_shardings": _derive.ANNOTATIONS,
    }
    if static_nums:
        options["static_argnums"] = tuple(static_nums)
    if static_names:
        options["static_argnames"] = tuple(static_names)
    return _derive.AnnotatedJit(fn, options, jax.jit)


def _trace(jitted: Any, args: tuple, kwargs: dict, mesh: Any) -> tuple:
    """`(traced, (positional, keyword) arguments as placed, compile-time checks
    scheduled)`: the step traced on `mesh`."""
    previous = _auto.watching.checks
    scheduled: list = []
    # Watched from the start: deriving the result's shardings traces the step
    # first, and the trace that follows may be that one, from JAX's cache.
    _auto.watching.checks = scheduled
    try:
        with compat.mesh_scope(mesh):
            inner, pos, kw = jitted.prepared(
                *abstract(args, mesh), **abstract(kwargs, mesh)
            )
            traced = inner.trace(*pos, **kw)
    finally:
        _auto.watching.checks = previous
    # One per place and annotation, however many times the step was traced.
    unique = list({(c.site, c.cls): c for _, c in scheduled}.values())
    return traced, (pos, kw), unique


def _compile(jitted: Any, args: tuple, kwargs: dict, check_mesh: Mesh) -> Any:
    """Compiles the step on `check_mesh` (nothing runs): the compile-time checks
    (Auto axes) report what XLA's partitioner chose there."""
    with compat.mesh_scope(check_mesh):
        inner, pos, kw = jitted.prepared(
            *abstract(args, check_mesh), **abstract(kwargs, check_mesh)
        )
        return inner.lower(*pos, **kw).compile()


def _report(
    name: str,
    jitted: Any,
    placed: tuple,
    given: tuple,
    outputs: Any,
    mesh: Any,
    scheduled: list,
    compiled_on: Optional[str],
) -> PreflightReport:
    signature = _signature.read(jitted)
    pos, kw = placed
    explicit = set(mesh.axis_types) <= {AxisType.Explicit}
    rows: list[LeafBytes] = []
    arguments = list(signature.arguments(pos, kw))
    # The arguments a `jts.Like[...]` names: their leaves lay the others out.
    likes = _like_hint.like_plans(signature, [(a, v) for a, v, _ in arguments])
    for arg, value, hint in arguments:
        if not has_arrays(value):
            continue  # static
        if isinstance(hint, _reading.Unread):
            hint = None  # declares nothing: its leaves count as unannotated
        rows += _rows(arg, arg, value, hint, mesh, explicit, likes)
    returned = signature.hint("return")
    rows += _rows("outputs", "outputs", outputs, returned, mesh, False, likes)
    unannotated = tuple(r.path for r in rows if not r.annotated)
    not_checked = []
    if scheduled and compiled_on is None:
        sites = ", ".join(dict.fromkeys(c.site.describe() for c in scheduled[:3]))
        not_checked.append(
            f"{len(scheduled)} checks of values on Auto mesh axes, which only XLA's "
            f"partitioner decides (e.g. {sites}): pass `check_mesh=` (a real mesh "
            "with these axis names) to compile the step there and run them"
        )
    if AxisType.Auto in tuple(mesh.axis_types):
        # On Auto axes nothing gives an abstract input its layout: one given
        # without is placed as annotated, unchecked (issue 36's planted bug).
        bare = unplaced(signature.arguments(*given), mesh)
        named = [r.path for r in rows if r.annotated and r.path in bare]
        if named:
            not_checked.append(
                f"the layout of {len(named)} input leaves given without a sharding "
                "(placed as annotated, so their own layout is not checked; "
                "`jax.eval_shape` gives none on Auto axes): "
                + ", ".join(named[:5])
                + (", ..." if len(named) > 5 else "")
            )
    unknown = [r.path for r in rows if r.bytes_per_device is None]
    if unknown:
        not_checked.append(
            f"the layout (and bytes) of {len(unknown)} leaves with no sharding "
            f"annotated, which XLA chooses on Auto axes: {', '.join(unknown[:5])}"
            + (", ..." if len(unknown) > 5 else "")
        )
    checks = Checks(
        traced_on=_mesh.format_mesh(mesh),
        leaves_checked=sum(r.annotated for r in rows),
        unannotated=unannotated,
        compile_time=len(scheduled),
        compiled_on=compiled_on,
        not_checked=tuple(not_checked),
    )
    return PreflightReport(name, mesh, rows, checks)


def _rows(
    group: str,
    name: str,
    value: Any,
    hint: Any,
    mesh: Any,
    explicit: bool,
    likes: dict,
) -> list[LeafBytes]:
    leaves, plan = _tree.plan_for(value, hint)
    annotations = list(plan.annotations)
    found = _like_hint.sources(value, plan.paths, leaves, hint, likes, "preflight")
    for i, source in found.items():
        if source.spec is not None:  # laid out by `jts.Like`'s rule
            annotations[i] = source.spec
    rows = []
    for leaf, annotation, path in zip(leaves, annotations, plan.paths):
        if not is_array(leaf):
            continue
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else None
        if spec is None and (
            explicit or (sharding is not None and sharding.is_fully_replicated)
        ):
            # Unplaced, on Explicit axes: traced replicated; or what XLA chose.
            spec = PartitionSpec()
        top = name + jax.tree_util.keystr(path[:1])
        row_path = name + jax.tree_util.keystr(path)
        annotated = has_sharding(annotation)
        if spec is None and annotated:
            # Annotated but not laid out by `jit` (a returned NNX Variable's
            # metadata, with no return hint): on Auto axes the trace gives no
            # layout, and the check at compile time holds it to this one.
            spec = _bridge.spec_for(annotation, tuple(leaf.shape), mesh, row_path)
        rows.append(leaf_bytes(group, row_path, top, leaf, spec, annotated, mesh))
    return rows


def _head(name: str, mesh: Any) -> str:
    return f"preflight of `{name}` on mesh {_mesh.format_mesh(mesh)}"


def _mismatches(head: str, found: list) -> list[str]:
    """Every mismatch, numbered in the order found, by line; the fix said once."""
    count = len(found)
    lines = [
        f"{head}: {count} sharding mismatch{'es' if count > 1 else ''} (the trace "
        "went on past each):"
    ]
    fix = False
    for i, finding in enumerate(found, 1):
        text = finding.message.replace(FIX, "").rstrip(" .")
        fix = fix or text != finding.message.rstrip(" .")
        where = f"{finding.location}: " if finding.location else ""
        lines.append(f"  {i}. {where}{text}.")
    return lines + ([FIX] if fix else [])
