"""`collectives`: the collectives of a compiled step, each with the line that
caused it.

Lowers and compiles the function for the given arguments through JAX's own
caches (a step already called compiles nothing again; nothing runs, no data
moves), reads the collectives from the compiled module (`hlo.py`), maps each
one's device groups back to the mesh's axis names and each operand to the
user's line and the nearest annotated function (`sources.py`).
"""

import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, Union

import jax

from .._rules.scope import per_call_step as _per_call_step
from . import (
    budget as _budget,
    call_sites as _sites,
    export as _export,
    groups as _groups,
    hlo as _hlo,
    no_comm as _no_comm,
    operand_layout as _layouts,
    rollup as _rollup,
    table as _table,
)
from .rows import Branch, Collective, Loop, Part, Total  # noqa: F401
from .sources import Resolver, Sources
from .text import function_name as _function_name


class Collectives:
    """What [`jaxtyping_shard.collectives`][] returns: rows to assert on, a table
    when printed, totals per kind and per mesh axes, and a budget to hold."""

    def __init__(self, rows: Iterable[Collective], function: str, mesh: Any):
        self.rows: tuple[Collective, ...] = tuple(rows)
        self.function = function
        self.mesh = mesh

    @property
    def count(self) -> int:
        """Collectives run per call, at most: of each conditional's branches,
        the one that runs the most (a call runs one)."""
        return at_most(self.rows).count

    @property
    def bytes(self) -> int:
        """Bytes each device receives (and sends) over one call, at most: of
        each conditional's branches, the one that moves the most."""
        return at_most(self.rows).bytes

    @property
    def branched(self) -> bool:
        """Whether some collective is inside a `lax.cond` / `lax.switch` branch
        (so the totals are what a call runs at most)."""
        return any(r.branches for r in self.rows)

    def by_kind(self) -> dict[str, Total]:
        """Totals per kind (`all-gather`, `all-reduce`, ...)."""
        return self._totals(lambda r: r.kind)

    def by_axes(self) -> dict[str, Total]:
        """Totals per combination of mesh axes (`data`, `data+model`)."""
        return self._totals(lambda r: r.over)

    def by_phase(self) -> dict[str, Total]:
        """Totals per pass, `forward`, `backward` and `other` (each part's
        `phase`): they add up to `count` and `bytes` (`rollup()`'s root)."""
        return dict(self.rollup().passes)

    def rollup(self, by: str = "path") -> "_rollup.Node":
        """The collectives rolled up into a tree of `Node`s (`name`, `path`,
        `count`, `bytes`, `passes`, `children`; `find("blocks[*].attn")`),
        the root the step: `by="path"` along each part's module path
        (`Part.path`: `blocks[*].attn`), `by="annotated"` by the nearest
        annotated function of its call site (one level). The nodes add up to
        the report's totals exactly; printed, an indented tree."""
        if by == "path":
            key: Callable[[Part], tuple[str, ...]] = lambda p: p.path  # noqa: E731
        elif by == "annotated":
            key = _annotated
        else:
            raise ValueError(
                f"rollup(by={by!r}): expected by='path' (the module path of each "
                "part) or by='annotated' (the nearest annotated function)"
            )
        return _rollup.rollup(self.rows, self.function, key)

    def table(self, detail: str = "rows") -> str:
        """The report as text at a level of detail: `summary` (the totals by
        kind, axes and pass), `modules` (the roll-up tree), `rows` (the
        table `str(report)` prints) or `frames` (each row's parts with their
        pass, layout before -> after, module path and call chain)."""
        return _table.at_detail(self, detail)

    def to_json(self) -> str:
        """The report as a JSON string: every row with its fields, the
        roll-up and the totals (schema: docs/collectives.md)."""
        return _export.to_json(self)

    def _totals(self, key: Callable[[Collective], str]) -> dict[str, Total]:
        grouped: dict[str, list[Collective]] = {}
        for row in self.rows:
            grouped.setdefault(key(row), []).append(row)
        return {k: at_most(rows) for k, rows in sorted(grouped.items())}

    def where(
        self,
        kind: Union[str, Iterable[str], None] = None,
        axes: Union[str, Iterable[str], None] = None,
        inside: Union[str, Iterable[str], None] = None,
        outside: Union[str, Iterable[str], None] = None,
        loop: Optional[str] = None,
        deferred: Optional[bool] = None,
    ) -> "Collectives":
        """The collectives of these kinds, running over all of these axes, whose
        parts come from lines inside (or outside) these functions.

        `loop="inside"` / `"outside"`: inside a `while` loop (a `lax.scan`)
        or outside every loop; `deferred=`: the deferred reductions or not.

        A function is named by its qualified name (`Attention.__call__`) or its
        last part (`__call__`). A line is inside the function that holds it and
        inside the nearest annotated function around it (`Source.function`,
        `Source.annotated`), not inside their callers: the rule "no all-gather
        over `data` outside the functions that gather weights" flags one made in
        a function they call. A part with no source is outside every function.
        Selecting by function needs JAX >= 0.9 (JAX 0.8 keeps no functions).
        """
        return Collectives(
            _budget.select(
                self.rows, self.mesh, kind, axes, inside, outside, loop, deferred
            ),
            self.function,
            self.mesh,
        )

    def check(
        self,
        baseline: Union[str, "os.PathLike[str]", None] = None,
        *,
        max_bytes: Optional[int] = None,
        forbid: Iterable[Mapping[str, Any]] = (),
        at_most: Iterable[Mapping[str, Any]] = (),
        update: bool = False,
    ) -> None:
        """Holds the step to its budget; raises
        [`jaxtyping_shard.CollectiveBudgetError`][] naming every line over it.

        **Arguments:**

        - `baseline`: a JSON file written by `save`: every collective whose line
            is not in it, or that moves more tensors or bytes than it says, fails.
        - `max_bytes`: a bound on the bytes each device receives per call.
        - `forbid`: selections as `where` takes them (`{"kind": "all-gather",
            "axes": "data", "outside": ["gather"]}`): any collective they
            select fails.
        - `at_most`: selections as `where` takes them, each with `count` (runs
            per call, loop trips counted) and / or `bytes` (per device).
            "Over `data`: one all-reduce per step, outside the micro-batch
            loop": `at_most=[{"kind": "all-reduce", "axes": "data", "count":
            1}], forbid=[{..., "loop": "inside"}]`.
        - `update`: write the baseline instead of comparing with it (the other
            bounds still hold).
        """
        _budget.check(self, baseline, max_bytes, forbid, update, at_most)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the baseline that `check` compares with (readable JSON)."""
        _budget.save(self, path)

    def __str__(self) -> str:
        return _table.table(self)

    def __repr__(self) -> str:
        return str(self)


Collectives.__module__ = "jaxtyping_shard"


@_per_call_step  # axis_rules=: the call runs under that table
def collectives(
    fn: Callable, *args: Any, axis_rules: Any = None, **kwargs: Any
) -> Collectives:
    """The collectives of `fn`'s compiled program for these arguments, each with
    the line that caused it.

    Nothing runs and no data moves: `fn` is lowered and compiled through JAX's
    caches (a step that was already called is not compiled again). Arrays may be
    given as `jax.ShapeDtypeStruct`s with shardings.

    !!! Example

        ```python
        report = jts.collectives(train_step, params, opt, batch)
        print(report)  # one row per collective: kind, axes, bytes, line
        assert report.where(kind="all-gather", axes="data").count == 9
        report.check("collectives.json", max_bytes=2**20)
        ```

    **Arguments:**

    - `fn`: a `jax.jit` or `jaxtyping_shard.jit` object, a plain function
        (compiled with `jax.jit`), or a `Lowered` / `Compiled` stage.
    - `*args`, `**kwargs`: what `fn` would be called with.
    - `axis_rules`: as for [`jaxtyping_shard.check_tree`][].

    **Returns:**

    A [`jaxtyping_shard.Collectives`][]: `rows` (kind, mesh axes, bytes per
    device per call, and per part its shape and source: the first line outside
    the libraries and the nearest enclosing annotated function), a table when
    printed, totals `by_kind()` / `by_axes()`, `where(...)` and `check(...)`.
    """
    compiled = _compile(fn, args, kwargs)
    mesh = _groups.mesh_of(compiled)
    text = compiled.as_text()
    found, graph = _hlo.read(text)
    (module,) = compiled.runtime_executable().hlo_modules()[:1]
    sources = Sources(module.as_serialized_hlo_module_proto(), graph.computations)
    partitions = mesh.size if mesh is not None else _groups.num_partitions(text)
    coords = _groups.coordinates(mesh)
    explicit = _groups.explicit_axes(mesh)
    resolver = Resolver()
    differentiates = _rollup.differentiated(sources.op_names())
    rows = []
    for raw in found:
        axes, over, size = _groups.axes(
            raw.kind, raw.groups, raw.pairs, coords, mesh, partitions
        )
        reduces = raw.kind in ("all-reduce", "reduce-scatter") and bool(axes)
        reduces = reduces and set(axes) <= explicit
        parts = []
        for operand in raw.operands:
            op_name = sources.op_name_for(raw.name, operand.name, graph)
            before, after = _layouts.layouts(
                raw.kind, operand.dtype, operand.dims, raw.dimension, axes, size
            )
            parts.append(
                Part(
                    _shape(operand),
                    _moved(raw.kind, operand.bytes, size) * raw.executions,
                    resolver.source(sources.stack_for(raw.name, operand.name, graph)),
                    no_collectives=_no_comm.axes(op_name),
                    deferred=bool(
                        reduces
                        and (raw.op == "reshard" or graph.out_of_loop(operand.name))
                    ),
                    op_name=op_name,
                    phase=_rollup.phase(op_name, differentiates),
                    before=before,
                    after=after,
                )
            )
        parts = tuple(parts)
        rows.append(
            Collective(
                raw.kind,
                axes,
                over,
                size,
                sum(p.bytes for p in parts),
                raw.executions,
                parts,
                raw.name,
                raw.unknown_trips,
                tuple(
                    Branch(
                        b.conditional,
                        b.index,
                        b.count,
                        resolver.source(sources.stack(b.conditional)),
                    )
                    for b in raw.branches
                ),
                tuple(
                    Loop(name, trips, resolver.source(sources.stack(name)))
                    for name, trips in raw.loops
                ),
            )
        )
    rows = _sites.assign(rows, resolver, sources.stacks())
    rows = _rollup.paths(rows, _function_name(fn), resolver)
    rows.sort(key=_order)
    return Collectives(rows, _function_name(fn), mesh)


def _annotated(part: Part) -> tuple[str, ...]:
    found = _sites.of(part)
    if found is None:
        return ()
    name = found.annotated or found.function
    return (name,) if name else ()


def at_most(rows: Iterable[Collective]) -> Total:
    """What one call runs at most of `rows` (`budget.at_most`)."""
    return Total(*_budget.at_most(rows, lambda r: (r.executions, r.bytes)))


_jitted: "weakref.WeakKeyDictionary[Callable, Any]" = weakref.WeakKeyDictionary()


def _compile(fn: Callable, args: tuple, kwargs: dict) -> Any:
    if isinstance(fn, jax.stages.Compiled):
        return fn
    if isinstance(fn, jax.stages.Lowered):
        return fn.compile()
    lower: Any = getattr(fn, "lower", None)
    if lower is None and not callable(fn):
        raise TypeError(
            "collectives: expected a function, a `jax.jit` or `jaxtyping_shard.jit` "
            f"object, or a `Lowered` / `Compiled` stage; got {type(fn).__name__} "
            f"{fn!r}. Pass the step itself and its arguments: "
            "`jts.collectives(step, *args)`."
        )
    if lower is None:
        # A plain function: one `jax.jit` kept per function, so that a second
        # report on it finds JAX's trace cache too.
        try:
            jitted = _jitted.get(fn)
            if jitted is None:
                jitted = _jitted[fn] = jax.jit(fn)
        except TypeError:  # not weakly referenceable
            jitted = jax.jit(fn)
        lower = jitted.lower
    return lower(*args, **kwargs).compile()


def _moved(kind: str, size: int, n: int) -> int:
    """Bytes each device receives for one operand of `size` bytes on it, with
    the bandwidth-optimal (ring) algorithms, which send as much."""
    if kind == "all-gather":
        return size * (n - 1)  # the others' shards
    if kind == "all-reduce":
        return 2 * size * (n - 1) // n  # a reduce-scatter, then an all-gather
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return size * (n - 1) // n
    return size  # collective-permute, collective-broadcast: one buffer


def _shape(operand: _hlo.Operand) -> str:
    dims = ",".join(str(d) for d in operand.dims)
    return f"{_hlo.jax_dtype(operand.dtype)}[{dims}]"


def _order(row: Collective) -> tuple:
    first = next((_sites.of(p) for p in row.parts if p.source is not None), None)
    return (
        row.kind,
        row.axes,
        first is None,
        (first.file, first.line) if first else ("", 0),
        row.name,
    )
