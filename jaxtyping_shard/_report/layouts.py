"""`layouts`: the layout of every intermediate of a step, by line and function.

On a mesh whose axes are all Explicit the layouts are the trace's types: each
operation of the jaxpr (those inside `jit`, `scan`, `cond`, `remat`,
`custom_vjp` ... included) with the sharding of its results, and the user's
line from its source info. On a mesh with Auto axes they are what XLA's
propagation decided, read from the module after that pass (`propagated.py`),
each instruction with the user's line from its metadata. Each row's line is
its call site (`call_sites.py`): a helper's line used from several lines is
told apart by its callers, as in a report of collectives.
"""

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import jax
from jax.sharding import AxisType

from .._core import mesh as _mesh
from .._layout import spec as _spec
from .._rules.scope import per_call_step as _per_call_step
from . import (
    call_sites as _sites,
    groups as _groups,
    hlo as _hlo,
    layout_baseline as _baseline,
    propagated as _propagated,
)
from .sources import Frame, Resolver, Sources
from .text import function_name as _function_name


TYPES, XLA = "types", "xla"  # where a report's layouts come from


@dataclass(frozen=True)
class Layout:
    """One intermediate: the operation that made it, where, and its layout."""

    op: str  # the JAX primitive (`dot_general`, `add`)
    shape: str  # `float32[8,6]`
    layout: str  # in JAX's notation: `float32[8@data,6@model]`; `?{...}`: unread
    site: Optional[_sites.CallSite]  # the user's line; None: no source
    function: str  # the function holding the line ("" if unknown: JAX 0.8)
    read: bool = True  # False: XLA's sharding could not be read as mesh axes

    @property
    def key(self) -> tuple:
        """What a baseline keys it by: the function, its call site's lines
        (file and stripped text, never the number), and the operation."""
        where = self.site.key if self.site is not None else (_NO_SOURCE,)
        return (self.function, where[0], where[1:], self.op)

    def __str__(self) -> str:
        at = str(self.site) if self.site is not None else _NO_SOURCE
        return f"{at}: {self.op} -> {self.layout}"


_NO_SOURCE = "(no source line)"


class Layouts:
    """What [`jaxtyping_shard.layouts`][] returns: a row per intermediate, a
    table when printed, and a baseline to hold (`save`, `check`)."""

    def __init__(self, rows: Iterable[Layout], function: str, mesh: Any, source: str):
        self.rows: tuple[Layout, ...] = tuple(rows)
        self.function = function
        self.mesh = mesh
        self.source = source  # "types" (the trace's) or "xla" (propagated)

    @property
    def unread(self) -> tuple[Layout, ...]:
        """The rows whose layout XLA wrote in a form not read as mesh axes."""
        return tuple(r for r in self.rows if not r.read)

    def where(self, line: Optional[str] = None, op: Optional[str] = None) -> "Layouts":
        """The rows whose call site's text contains `line`, of operation `op`."""
        rows = [
            r
            for r in self.rows
            if (op is None or r.op == op)
            and (line is None or (r.site is not None and line in r.site.text))
        ]
        return Layouts(rows, self.function, self.mesh, self.source)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes this JAX release's section of the baseline that `check`
        compares with (readable JSON; other releases' sections are kept)."""
        _baseline.save(self, path)

    def check(
        self,
        baseline: Union[str, "os.PathLike[str]"],
        *,
        update: bool = False,
        allow_unread: bool = False,
    ) -> None:
        """Holds every intermediate to the layout the baseline says; raises
        [`jaxtyping_shard.LayoutChangeError`][] naming each line laid out anew
        (old and new layout), each new one and each gone. A report with no
        intermediates, or with layouts not read (`unread`, unless
        `allow_unread=True`), fails too: nothing passes unchecked.
        `update`: write the baseline instead (the pytest option
        `--update-layouts` does, through the `check_layouts` fixture)."""
        _baseline.check(self, baseline, update, allow_unread)

    def __str__(self) -> str:
        head = (
            f"layouts of `{self.function}` on mesh {_mesh.format_mesh(self.mesh)} "
            f"({'from the trace' if self.source == TYPES else 'as XLA propagated'}"
            f"): {len(self.rows)} intermediates"
        )
        if not self.rows:
            return head + " (none: the step makes no intermediate)"
        lines = [head]
        for row in self.rows:
            at = str(row.site) if row.site is not None else _NO_SOURCE
            lines.append(f"  {row.layout:<32} {row.op:<20} {at}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


Layouts.__module__ = Layout.__module__ = "jaxtyping_shard"


@_per_call_step  # axis_rules=: the call runs under that table
def layouts(fn: Any, *args: Any, axis_rules: Any = None, **kwargs: Any) -> Layouts:
    """The layout of every intermediate of `fn` for these arguments, each with
    its line and function.

    Nothing runs and no data moves. On a mesh whose axes are all Explicit the
    layouts are the trace's types; with Auto axes, the shardings XLA's
    propagation chose, read from one compile with XLA's dump of the module
    after that pass (no operation is added to the program).

    !!! Example

        ```python
        report = jts.layouts(train_step, params, opt, batch)
        print(report)  # a row per intermediate: layout, operation, line
        report.check("layouts.json")  # fails naming each line laid out anew
        ```

    **Arguments:**

    - `fn`: a `jax.jit` or `jaxtyping_shard.jit` object, or a plain function.
    - `*args`, `**kwargs`: what `fn` would be called with (arrays or
        `jax.ShapeDtypeStruct`s with shardings).
    - `axis_rules`: as for [`jaxtyping_shard.check_tree`][].

    **Returns:**

    A [`jaxtyping_shard.Layouts`][]: `rows` (operation, shape, layout in JAX's
    notation, call site, function), `save(path)` and `check(path)`.
    """
    traced = _trace(fn, args, kwargs)
    jaxpr = getattr(traced.jaxpr, "jaxpr", traced.jaxpr)
    mesh = _mesh_of(jaxpr)
    resolver = Resolver()
    if mesh is not None and all(t == AxisType.Explicit for t in mesh.axis_types):
        found = list(_from_types(jaxpr, (), resolver))
        return Layouts(_sited(found, resolver, ()), _function_name(fn), mesh, TYPES)
    compiled, text, proto = _propagated.compile_dumped(traced.lower())
    if text is None:
        raise RuntimeError(
            f"layouts: XLA wrote no module after sharding propagation for "
            f"`{_function_name(fn)}`, so its layouts cannot be read: the compile "
            "came from JAX's persistent compilation cache (which leaves XLA's dump "
            "options out of its key; JAX 0.12 cannot be told to skip it once it "
            "is in use), or this XLA names the pass otherwise than "
            f"{' / '.join(_propagated._PASSES)}. Run it in a process without the "
            "persistent cache (`jax_enable_compilation_cache=False` before the "
            "first compile)."
        )
    concrete = _groups.mesh_of(compiled)
    found = []
    for raw in _propagated.read(text, proto, concrete):
        source = resolver.source(raw.stack)
        dtype = _hlo.jax_dtype(raw.dtype)
        shape = _spec.format_array(dtype, raw.dims, ())
        if raw.entries is None:
            layout, read = f"{shape}?{raw.sharding}", False
        elif raw.entries == _propagated.MANUAL:
            layout, read = f"{shape}{{manual}}", True
        else:
            layout, read = _spec.format_array(dtype, raw.dims, raw.entries), True
        found.append((raw.op, shape, layout, source, read))
    stacks = Sources(proto).stacks() if proto is not None else []
    return Layouts(_sited(found, resolver, stacks), _function_name(fn), concrete, XLA)


def _trace(fn: Any, args: tuple, kwargs: dict) -> Any:
    trace = getattr(fn, "trace", None)
    if trace is None:
        if not callable(fn):
            raise TypeError(
                "layouts: expected a function or a `jax.jit` / `jaxtyping_shard.jit` "
                f"object; got {type(fn).__name__} {fn!r}. Pass the step itself and "
                "its arguments: `jts.layouts(step, *args)`."
            )
        trace = jax.jit(fn).trace
    return trace(*args, **kwargs)


def _mesh_of(jaxpr: Any) -> Any:
    """The mesh the trace's types name (that of `jax.set_mesh` else)."""
    for var in (*jaxpr.invars, *jaxpr.outvars, *_outvars(jaxpr)):
        sharding = getattr(getattr(var, "aval", None), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "axis_names", ()):
            return mesh
    context = jax.sharding.get_abstract_mesh()
    return context if getattr(context, "axis_names", ()) else None


def _outvars(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield from eqn.outvars


def _inner(eqn: Any) -> list:
    """The jaxprs an equation holds (`jit`, `scan`, `cond`'s branches, ...)."""
    out = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def _stack(eqn: Any, outer: tuple[Frame, ...], resolver: Resolver) -> tuple:
    traceback = getattr(eqn.source_info, "traceback", None)
    frames = tuple(
        Frame(f.file_name, f.function_name, f.line_num)
        for f in getattr(traceback, "frames", None) or ()
    )
    # An inner jaxpr JAX kept no user frame for (`jax.nn.relu`'s): its caller's.
    return frames if resolver.user(frames) else outer


def _from_types(jaxpr: Any, outer: tuple[Frame, ...], resolver: Resolver) -> Iterator:
    for eqn in jaxpr.eqns:
        stack = _stack(eqn, outer, resolver)
        inner = _inner(eqn)
        if inner:
            for sub in inner:
                yield from _from_types(sub, stack, resolver)
            continue
        for var in eqn.outvars:
            aval: Any = getattr(var, "aval", None)
            if getattr(aval, "shape", None) is None or not hasattr(aval, "dtype"):
                continue
            sharding = getattr(aval, "sharding", None)
            spec = getattr(sharding, "spec", None)
            entries = _spec.entries_of(spec) if spec is not None else ()
            shape = _spec.format_array(aval.dtype, aval.shape, ())
            layout = _spec.format_array(aval.dtype, aval.shape, entries, spec)
            types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
            if AxisType.Manual in (types or ()):
                layout = f"{shape}{{manual}}"  # a `shard_map` body's: its shard
            source = resolver.source(stack)
            yield (eqn.primitive.name, shape, layout, source, True)


def _sited(found: list, resolver: Resolver, stacks: Iterable) -> list[Layout]:
    """Rows with each line's call site (the rule of `call_sites.py`, over these
    rows' stacks and the program's), in the order of their lines."""
    chains = [_sites.chain(resolver.user(s)) for s in stacks]
    chains += [_sites.chain(s.frames) for *_, s, _ in found if s is not None]
    depths = _sites.depths(chains)
    rows = []
    for op, shape, layout, source, read in found:
        site = None
        if source is not None:
            depth = depths.get(_sites.chain(source.frames), 1)
            site = _sites.site(source, depth, resolver)
        function = site.function if site is not None else ""
        rows.append(Layout(op, shape, layout, site, function, read))
    rows.sort(key=lambda r: (r.site is None, _at(r), r.op, r.layout))
    return rows


def _at(row: Layout) -> tuple:
    return (row.site.file, row.site.line) if row.site is not None else ("", 0)
