"""The baseline of a report of layouts: the JSON file `Layouts.save` writes and
`Layouts.check` compares with.

One entry per (function, call site, operation): the layouts of the
intermediates made there, sorted (a line that makes several arrays, or a
helper's line called from a loop, lists each). A line is named as the
baseline of collectives names it, by its file's name and stripped text (`#k`
for the k-th of several same lines in the file) and the helpers' lines
inside its call site, never by its number: a line added above the step, or an
edit to a function the step does not call, changes no key. One section per
JAX release (each traces and propagates its own way), as in
`collectives.json`.
"""

import os
from collections import Counter
from typing import Any, Union

import jax

from .._core import compat as _compat, mesh as _mesh
from .._core.errors import LayoutChangeError
from . import baseline_file as _file


FORMAT = "jaxtyping_shard layouts baseline 1"
_WHAT, _BY = "layouts", "Layouts.save"
_UPDATE = (
    "If the change is meant, rewrite the baseline: `pytest --update-layouts` "
    "(the `check_layouts` fixture), or `report.save({path!r})`."
)


def entries(report: Any) -> dict[tuple, dict]:
    """The baseline's entries of a report, by key (`Layout.key`)."""
    out: dict[tuple, dict] = {}
    for row in report.rows:
        key = row.key
        entry = out.get(key)
        if entry is None:
            function, where, via, op = key
            entry = out[key] = {"in": function, "where": where}
            if via:
                entry["via"] = list(via)
            entry.update({"op": op, "layouts": []})
        entry["layouts"].append(row.layout)
    for entry in out.values():
        entry["layouts"].sort()
    return dict(sorted(out.items()))


def _entry_key(entry: dict) -> tuple:
    return (entry["in"], entry["where"], tuple(entry.get("via", ())), entry["op"])


def save(report: Any, path: Union[str, "os.PathLike[str]"]) -> None:
    """Writes this JAX release's section, keeping the other releases'."""
    sections = load(path)["jax"] if os.path.exists(path) else {}
    sections[jax.__version__] = {
        "mesh": _mesh.sizes(report.mesh) if report.mesh is not None else {},
        "from": report.source,
        "intermediates": len(report.rows),
        "layouts": list(entries(report).values()),
    }
    _file.write(path, FORMAT, report.function, sections, "layouts")


def load(path: Union[str, "os.PathLike[str]"]) -> dict:
    return _file.read(path, (FORMAT,), _WHAT, _BY)


def _at(report: Any, key: tuple) -> str:
    """The line of a key as it is now: `model.py:12 in `f`: h = x @ w`."""
    for row in report.rows:
        if row.key == key and row.site is not None:
            return str(row.site)
    return _said(key)


def _said(key: tuple) -> str:
    function, where, via, _ = key
    said = f"{where} in `{function}`" if function else where
    return said + (f" (via {', '.join(via)})" if via else "")


def against(report: Any, path: Union[str, "os.PathLike[str]"]) -> list[str]:
    """Each intermediate laid out otherwise than the baseline at `path` says,
    each new one and each gone."""
    shown = os.fspath(path)
    if not os.path.exists(path):
        return [
            f"no baseline at {shown}: write it with `report.save({shown!r})` or "
            "`pytest --update-layouts`"
        ]
    sections = load(path)["jax"]
    section = sections.get(jax.__version__)
    if section is None:
        return [
            f"no baseline for JAX {jax.__version__} in {shown} (it holds "
            f"{', '.join(sorted(sections, key=_compat._version)) or 'none'}): each "
            "JAX release traces and propagates a step its own way; add its section "
            f"with `report.save({shown!r})` or `pytest --update-layouts`"
        ]
    old = {_entry_key(e): e["layouts"] for e in section["layouts"]}
    now = {k: e["layouts"] for k, e in entries(report).items()}
    problems = []
    now_mesh = _mesh.sizes(report.mesh) if report.mesh is not None else {}
    if section.get("mesh") != now_mesh:
        problems.append(
            f"the baseline was taken on mesh {section.get('mesh')}, this report on "
            f"{now_mesh}"
        )
    gone = [k for k in old if k not in now]
    found = []
    for key in now:
        before, after = old.get(key), now[key]
        if before is None:
            # The line itself edited (its text is its key): the entry gone from
            # the same function, operation and helpers, in order, is its past.
            was = next((g for g in gone if g[0] == key[0] and g[2:] == key[2:]), None)
            if was is not None:
                gone.remove(was)
                before = old[was]
                if before == after:
                    continue
                change = _change(before, after)
                found.append(
                    (_order(report, key), f"laid out anew: {key[3]} at "
                     f"{_at(report, key)} (was `{was[1]}`): {change}")
                )  # fmt: skip
                continue
            found.append(
                (_order(report, key), f"new: {key[3]} -> {', '.join(after)} at "
                 f"{_at(report, key)}")
            )  # fmt: skip
        elif before != after:
            found.append(
                (_order(report, key), f"laid out anew: {key[3]} at "
                 f"{_at(report, key)}: {_change(before, after)}")
            )  # fmt: skip
    for key in gone:
        found.append(
            ((1, "", 0), f"gone: {key[3]} -> {', '.join(old[key])} at "
             f"{_said(key)} (no longer made)")
        )  # fmt: skip
    problems += [text for _, text in sorted(found)]
    return problems


def _change(before: list, after: list) -> str:
    was = Counter(before) - Counter(after)
    is_ = Counter(after) - Counter(before)
    return (
        f"{', '.join(sorted(was.elements())) or '-'} -> "
        f"{', '.join(sorted(is_.elements())) or '-'}"
    )


def _order(report: Any, key: tuple) -> tuple:
    """Problems in the order of the lines they name."""
    for row in report.rows:
        if row.key == key and row.site is not None:
            return (0, row.site.file, row.site.line)
    return (1, "", 0)


def check(report: Any, baseline: Any, update: bool, allow_unread: bool) -> None:
    problems: list[str] = []
    if not report.rows:
        problems.append(
            "no intermediates: the step makes no array (or none with a JAX "
            "operation behind it), so there is no layout to hold"
        )
    if report.unread and not allow_unread:
        listed = "; ".join(f"{r.layout} at {r.site}" for r in report.unread[:5])
        problems.append(
            f"{len(report.unread)} layout(s) XLA wrote that could not be read as "
            f"mesh axes (held only with `allow_unread=True`): {listed}"
        )
    if update:
        save(report, baseline)
    else:
        problems += against(report, baseline)
    if problems:
        lines = [
            f"`{report.function}`: {len(problems)} problem(s) with the layouts of "
            f"its intermediates on mesh {_mesh.format_mesh(report.mesh)} "
            f"(baseline {os.fspath(baseline)}):"
        ]
        lines += [f"  {i}. {p}" for i, p in enumerate(problems, 1)]
        lines.append(_UPDATE.format(path=os.fspath(baseline)))
        raise LayoutChangeError("\n".join(lines))
