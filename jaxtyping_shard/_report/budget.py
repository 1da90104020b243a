"""The budget of a report of collectives: selections, the baseline file, the
checks, and the table.

The baseline is a JSON file with one entry per (kind, mesh axes, call site,
annotated function): how many arrays that site makes a collective move per
call, and how many bytes (a site: its line and the helpers' lines inside it,
`call_sites.py`; a merged collective's parts each counted at their own site).
A line is named by its file's name and its stripped text (`model.py: q =
project(x, ...)`), with `#k` when the same text is the k-th of several in that
file, never by its number, so that an edit above it changes nothing. What XLA
decides on its own (which collectives to merge, their order, their names) is
not in the file, so it is the same on Explicit and Auto meshes and on any
number of processes when the program is the same.
"""

import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import jax

from .._core import compat as _compat, mesh as _mesh
from .._core.errors import CollectiveBudgetError
from . import (
    baseline_file as _file,
    call_sites as _sites,
    hlo as _hlo,
    no_comm as _no_comm,
)
from .table import branches, loops, NO_SOURCE
from .text import format_bytes


FORMAT = "jaxtyping_shard collectives baseline 2"
# Format 1 (before call sites): entries keyed by the line that made the operand.
# Still read: its sections are marked `"keyed": "line"` and judged so.
_FORMAT_1 = "jaxtyping_shard collectives baseline 1"
_BY_LINE = "line"
_FORMATS = (FORMAT, _FORMAT_1)
_WHAT, _BY = "collectives", "Collectives.save"
_UPDATE = (
    "If the change is meant, rewrite the baseline: `pytest --update-collectives` "
    "(the `check_collectives` fixture), or `report.save({path!r})`."
)


def _names(value: Union[str, Iterable[str], None], what: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    names = frozenset([value] if isinstance(value, str) else value)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}: expected a name or names, got {value!r}")
    return names


def _in_function(part: Any, functions: frozenset[str]) -> bool:
    """Whether a part's line is in one of `functions`: the function holding the
    line, or the nearest annotated function around it (by qualified name or its
    last part)."""
    source = part.source
    if source is None:
        return False
    return any(
        name and (name in functions or name.rpartition(".")[2] in functions)
        for name in (source.function, source.annotated)
    )


def select(
    rows: Iterable[Any],
    mesh: Any,
    kind: Any,
    axes: Any,
    inside: Any,
    outside: Any,
    loop: Optional[str] = None,
    deferred: Optional[bool] = None,
) -> list:
    kinds, over = _names(kind, "kind"), _names(axes, "axes")
    if loop not in (None, "inside", "outside"):
        raise ValueError(
            f"where(loop=...): expected 'inside' (in a `while` loop: a `lax.scan` "
            f"over micro-batches or layers) or 'outside' (once per call); got {loop!r}"
        )
    if deferred not in (None, True, False):
        raise TypeError(
            f"where(deferred=...): expected True or False, got {deferred!r}"
        )
    ins, outs = _names(inside, "inside"), _names(outside, "outside")
    unknown = kinds - set(_hlo.KINDS)
    if unknown:
        raise ValueError(
            f"where(kind=...): {sorted(unknown)} is not a collective XLA emits; "
            f"the kinds are {', '.join(_hlo.KINDS)}"
        )
    if (ins or outs) and not _compat.hlo_stack_frames_usable():
        raise ValueError(
            "where(inside=..., outside=...): selecting by function needs the frames "
            f"that JAX >= 0.9 keeps in a compiled program; JAX {jax.__version__} "
            "keeps one line per operation, without its function. Select by kind "
            "and axes here, or upgrade JAX."
        )
    if over and mesh is not None and not over <= set(mesh.axis_names):
        raise ValueError(
            f"where(axes=...): {sorted(over - set(mesh.axis_names))} is not an axis "
            f"of the mesh {_mesh.format_mesh(mesh)}"
        )
    out = []
    for row in rows:
        if (kinds and row.kind not in kinds) or not over <= set(row.axes):
            continue
        if loop is not None and row.in_loop != (loop == "inside"):
            continue
        parts = tuple(
            p
            for p in row.parts
            if (not ins or _in_function(p, ins))
            and not (outs and _in_function(p, outs))
            and (deferred is None or p.deferred == deferred)
        )
        if not parts:
            continue
        if len(parts) < len(row.parts):
            row = row._replace(parts=parts, bytes=sum(p.bytes for p in parts))
        out.append(row)
    return out


def at_most(rows: Iterable[Any], value: Any, depth: int = 0) -> tuple[int, int]:
    """The sums of `value(row)` (a pair) that one call runs at most: over the
    rows outside any conditional, and of each conditional the branch with the
    most (each of the pair on its own: a bound on both, not always one
    branch's)."""
    first = second = 0
    conditionals: dict[str, dict[int, list]] = {}
    for row in rows:
        if len(row.branches) <= depth:
            a, b = value(row)
            first, second = first + a, second + b
            continue
        branch = row.branches[depth]
        branches = conditionals.setdefault(branch.conditional, {})
        branches.setdefault(branch.index, []).append(row)
    for branches in conditionals.values():
        totals = [at_most(inner, value, depth + 1) for inner in branches.values()]
        first += max(t[0] for t in totals)
        second += max(t[1] for t in totals)
    return first, second


def _key(row: Any, part: Any, legacy: bool = False) -> tuple:
    """A part's baseline key: kind, axes, its call site's line, the helpers'
    lines inside it (outermost first), and the annotated function (or the
    one holding the line). `legacy`: as baselines of format 1 key it, by the
    line that made the operand (its innermost user frame)."""
    found = part.source if legacy else _sites.of(part)
    if found is None:
        return (row.kind, row.over, NO_SOURCE, (), "")
    path = (found.where,) if legacy else _sites.key(part)
    return (row.kind, row.over, path[0], path[1:], found.annotated or found.function)


def entries(report: Any, legacy: bool = False) -> dict[tuple, dict]:
    """The baseline's entries of a report, by key (`_key`)."""
    out: dict[tuple, dict] = {}
    for row in report.rows:
        runs = row.executions
        for part in row.parts:
            key = _key(row, part, legacy)
            kind, over, where, via, function = key
            entry = out.get(key)
            if entry is None:
                entry = out[key] = {"kind": kind, "over": over, "where": where}
                if via:
                    entry["via"] = list(via)
                entry.update({"in": function, "arrays": 0, "bytes": 0})
            entry["arrays"] += runs
            entry["bytes"] += part.bytes
    return dict(sorted(out.items()))


def _entry_key(entry: dict) -> tuple:
    return (
        entry["kind"],
        entry["over"],
        entry["where"],
        tuple(entry.get("via", ())),
        entry["in"],
    )


def save(report: Any, path: Union[str, "os.PathLike[str]"]) -> None:
    """Writes this JAX release's section of the baseline at `path`, keeping the
    sections of other releases."""
    # Read by `load`, so that a format 1 file's other sections keep their mark.
    sections = load(path)["jax"] if os.path.exists(path) else {}
    found = list(entries(report).values())
    # What a call moves at most: of a conditional's branches, the largest.
    arrays, size = at_most(
        report.rows, lambda r: (r.executions * len(r.parts), r.bytes)
    )
    sections[jax.__version__] = {
        "mesh": _mesh.sizes(report.mesh) if report.mesh is not None else {},
        "arrays": arrays,
        "bytes": size,
        "collectives": found,
    }
    _file.write(path, FORMAT, report.function, sections, "collectives")


def load(path: Union[str, "os.PathLike[str]"]) -> dict:
    data = _file.read(path, _FORMATS, _WHAT, _BY)
    if data["format"] == _FORMAT_1:
        for section in data["jax"].values():
            if isinstance(section, dict):
                section.setdefault("keyed", _BY_LINE)
    return data


def _at(report: Any, key: tuple, legacy: bool = False) -> str:
    """The line of a key as it is now: `model.py:111 in `f`: text`."""
    for row in report.rows:
        for part in row.parts:
            found = _key(row, part, legacy)
            if found[:4] == key[:4] and found[2] != NO_SOURCE:
                where = part.source if legacy else _sites.of(part)
                return str(where) + branches(row)
    return key[2]


def against(report: Any, path: Union[str, "os.PathLike[str]"]) -> list[str]:
    """What is new or grown in `report` over the baseline at `path`."""
    if not os.path.exists(path):
        return [
            f"no baseline at {os.fspath(path)}: write it with "
            f"`report.save({os.fspath(path)!r})` or `pytest --update-collectives`"
        ]
    sections = load(path)["jax"]
    section = sections.get(jax.__version__)
    if section is None:
        return [
            f"no baseline for JAX {jax.__version__} in {os.fspath(path)} (it holds "
            f"{', '.join(sorted(sections, key=_compat._version)) or 'none'}): "
            "each JAX release compiles and annotates a step its own way; add its "
            f"section with `report.save({os.fspath(path)!r})` or "
            "`pytest --update-collectives`"
        ]
    legacy = section.get("keyed") == _BY_LINE
    old = {_entry_key(e): e for e in section["collectives"]}
    problems = []
    now_mesh = _mesh.sizes(report.mesh) if report.mesh is not None else {}
    if section.get("mesh") != now_mesh:
        problems.append(
            f"the baseline was taken on mesh {section.get('mesh')}, this report on "
            f"{now_mesh}"
        )
    for key, entry in entries(report, legacy).items():
        line = _at(report, key, legacy)
        what = f"{entry['kind']} over {entry['over'] or '-'}"
        before = old.get(key)
        if before is None:
            problems.append(
                f"new: {what}, {_arrays(entry['arrays'])}, "
                f"{format_bytes(entry['bytes'])} per device, at {line}"
            )
        elif entry["arrays"] > before["arrays"] or entry["bytes"] > before["bytes"]:
            problems.append(
                f"grown: {what} at {line}: {_arrays(before['arrays'])} -> "
                f"{_arrays(entry['arrays'])}, {format_bytes(before['bytes'])} -> "
                f"{format_bytes(entry['bytes'])} per device"
            )
    if problems and legacy:
        problems.append(
            f"(the section for JAX {jax.__version__} is of format 1, keyed by the "
            "line that made each operand, not by call site: a helper's line "
            "holds all its callers' collectives; rewrite it to key it by call site)"
        )
    return problems


def _what(row: Any) -> str:
    role = f" ({row.role})" if row.role else ""
    return f"{row.kind} over {row.over or '-'}{role}"


def _over_limits(report: Any, limits: Iterable[Mapping[str, Any]]) -> list[str]:
    """`at_most=`: each selection's collectives per call and bytes, bounded."""
    problems = []
    for limit in limits:
        if not isinstance(limit, Mapping) or not {"count", "bytes"} & set(limit):
            raise TypeError(
                "check(at_most=...): each item is a dict of `where`'s keywords "
                "with `count` and / or `bytes`, like {'kind': 'all-reduce', "
                f"'axes': 'data', 'count': 1}}; got {limit!r}"
            )
        selection = {k: v for k, v in limit.items() if k not in ("count", "bytes")}
        chosen = report.where(**selection)
        said = ", ".join(f"{k}={v!r}" for k, v in selection.items()) or "all"
        count, size = limit.get("count"), limit.get("bytes")
        if (count is None or chosen.count <= count) and (
            size is None or chosen.bytes <= size
        ):
            continue
        bound = ", ".join(
            f"{v} {k}" if k == "count" else f"{format_bytes(v)}"
            for k, v in (("count", count), ("bytes", size))
            if v is not None
        )
        lines = "; ".join(
            f"{_what(row)} x{row.executions} at "
            f"{source if source is not None else NO_SOURCE}{loops(row)}"
            for row in chosen.rows
            for source in row.sources or (None,)
        )
        problems.append(
            f"at most {bound} per call ({said}): {chosen.count} run, "
            f"{format_bytes(chosen.bytes)} per device: {lines}"
        )
    return problems


def _arrays(n: int) -> str:
    return f"{n} array" + ("" if n == 1 else "s")


def check(
    report: Any,
    baseline: Any,
    max_bytes: Optional[int],
    forbid: Iterable[Mapping[str, Any]],
    update: bool,
    limits: Iterable[Mapping[str, Any]] = (),
) -> None:
    problems: list[str] = []
    if baseline is not None:
        if update:
            save(report, baseline)
        else:
            problems += against(report, baseline)
    if max_bytes is not None and report.bytes > max_bytes:
        largest = sorted(entries(report).values(), key=lambda e: -e["bytes"])[:3]
        problems.append(
            f"{format_bytes(report.bytes)} per device per call, over the bound of "
            f"{format_bytes(max_bytes)}; the largest: "
            + "; ".join(
                f"{e['kind']} over {e['over'] or '-'} at {e['where']} "
                f"({format_bytes(e['bytes'])})"
                for e in largest
            )
        )
    problems += _no_comm.problems(report.rows, lambda p: str(_sites.of(p)))
    for selection in forbid:
        if not isinstance(selection, Mapping):
            raise TypeError(
                "check(forbid=...): each item is a dict of `where`'s keywords, "
                f"like {{'kind': 'all-gather', 'axes': 'data'}}; got {selection!r}"
            )
        chosen = report.where(**selection)
        said = ", ".join(f"{k}={v!r}" for k, v in selection.items())
        for row in chosen.rows:
            for source in row.sources or (None,):
                problems.append(
                    f"forbidden ({said}): {_what(row)}, at "
                    f"{source if source is not None else NO_SOURCE}{loops(row)}"
                )
    problems += _over_limits(report, limits)
    if problems:
        where = f" (baseline {os.fspath(baseline)})" if baseline is not None else ""
        lines = [
            f"`{report.function}`: {len(problems)} problem(s) with its collectives "
            f"on mesh {_mesh.format_mesh(report.mesh)}{where}:"
        ]
        lines += [f"  {i}. {p}" for i, p in enumerate(problems, 1)]
        if baseline is not None:
            lines.append(_UPDATE.format(path=os.fspath(baseline)))
        raise CollectiveBudgetError("\n".join(lines))
