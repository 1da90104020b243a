"""A report of collectives as a table: a row per collective, a sub-row per
source line of a merged one, and the totals."""

from typing import Any

from .._core import mesh as _mesh
from .call_sites import chain
from .text import format_bytes


NO_SOURCE = "(no source: XLA moved it for a layout of the inputs or outputs)"


def describe(source: Any) -> str:
    """A part's source (or call site) in words: its line, or that it has none."""
    return NO_SOURCE if source is None else str(source)


def site_of(part: Any) -> Any:
    """A part's call site, else its source (rows made by hand), else None."""
    site = getattr(part, "site", None)
    return site if site is not None else part.source


def table(report: Any) -> str:
    most = "at most " if report.branched else ""
    head = (
        f"collectives of `{report.function}` on mesh "
        f"{_mesh.format_mesh(report.mesh)}: {most}{report.count} per call, "
        f"{most}{format_bytes(report.bytes)} per device"
    ) + (" (a call runs one branch of each conditional)" if most else "")
    cells = [("kind", "over", "bytes/device", "array", "line")]
    for row in report.rows:
        kind = row.kind + (f" x{row.executions}" if row.executions > 1 else "")
        if row.unknown_trips:
            kind += " (per loop step)"
        groups = _by_source(row.parts)
        branch = (f" [{row.role}]" if row.role else "") + branches(row) + loops(row)
        if len(groups) == 1:
            ((source, parts),) = groups
            shape = parts[0].shape if len(parts) == 1 else f"{len(parts)} arrays"
            cells.append(
                (
                    kind,
                    row.over or "-",
                    format_bytes(row.bytes),
                    shape,
                    describe(source) + branch,
                )
            )
            continue
        cells.append(
            (kind, row.over or "-", format_bytes(row.bytes), f"{len(row.parts)} "
             "arrays", f"merged by XLA from {len(groups)} lines{branch}:")
        )  # fmt: skip
        for source, parts in groups:
            shape = parts[0].shape if len(parts) == 1 else f"{len(parts)} arrays"
            size = format_bytes(sum(p.bytes for p in parts))
            cells.append(("", "", "  " + size, shape, "  " + describe(source)))
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [head]
    for i, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + c[4])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    for name, totals in (("by kind", report.by_kind()), ("by axes", report.by_axes())):
        said = ", ".join(
            f"{k or '-'} {t.count} ({format_bytes(t.bytes)})" for k, t in totals.items()
        )
        lines.append(f"{name}: {said or 'none'}")
    return "\n".join(line.rstrip() for line in lines)


def branches(row: Any) -> str:
    """` [in branch 1 of 2 of the conditional at f.py:9: runs only when it
    does]`, or `""` outside any conditional."""
    if not row.branches:
        return ""
    inner = ", within ".join(str(b) for b in reversed(row.branches))
    return f" [in {inner}: runs only when it does]"


def loops(row: Any) -> str:
    """` [inside the loop at train.py:80 (2 trips)]`: the innermost `while`
    around it, each trip runs it; `""` outside every loop."""
    if not row.loops:
        return ""
    inner = ", within ".join(str(loop) for loop in reversed(row.loops))
    return f" [inside {inner}]"


def _by_source(parts: tuple) -> list:
    """Parts grouped by the call site they come from, as printed (a site
    reached through several calls is one site)."""
    groups: dict[str, tuple[Any, list]] = {}
    for part in parts:
        site = site_of(part)
        groups.setdefault(describe(site), (site, []))[1].append(part)
    return list(groups.values())


DETAILS = ("summary", "modules", "rows", "frames")


def at_detail(report: Any, detail: str) -> str:
    """The report at one level of detail (`Collectives.table`)."""
    if detail not in DETAILS:
        raise ValueError(
            f"table(detail={detail!r}): expected one of "
            + ", ".join(repr(d) for d in DETAILS)
        )
    if detail == "rows":
        return table(report)
    full = table(report).splitlines()
    head, totals = full[0], full[-2:]
    passes = report.by_phase()
    by_pass = "by pass: " + ", ".join(
        f"{k} {t.count} ({format_bytes(t.bytes)})" for k, t in passes.items()
    )
    if detail == "summary":
        return "\n".join([head, *totals, by_pass])
    if detail == "modules":
        tree = report.rollup().lines()
        return "\n".join([head, "by module path:", *tree, *totals, by_pass])
    lines = [head]
    for row in report.rows:
        kind = row.kind + (f" x{row.executions}" if row.executions > 1 else "")
        lines.append(
            f"{kind} over {row.over or '-'}, {format_bytes(row.bytes)}, "
            f"{row.phase}{branches(row)}{loops(row)}"
        )
        for part in row.parts:
            path = ".".join(part.path) or "(root)"
            lines.append(
                f"  {part.phase:8}  {part.before} -> {part.after}  "
                f"{format_bytes(part.bytes)}  at {path}: {describe(site_of(part))}"
            )
            frames = chain(part.source.frames) if part.source is not None else ()
            for frame in reversed(frames):
                lines.append(f"      {frame}")
    return "\n".join([*lines, *totals, by_pass])
