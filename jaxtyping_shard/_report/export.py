"""A collectives report as JSON (`Collectives.to_json`): every row with its
fields, the roll-up by module path, and the totals; schema in
docs/collectives.md, versioned by its `format`."""

import json
import os
from typing import Any, Optional

import jax


FORMAT = "jaxtyping_shard collectives report 1"


def to_json(report: Any) -> str:
    mesh = report.mesh
    data = {
        "format": FORMAT,
        "function": report.function,
        "jax": jax.__version__,
        "mesh": (
            None
            if mesh is None or mesh.empty
            else {
                "axes": dict(zip(mesh.axis_names, mesh.axis_sizes)),
                "axis_types": [t.name for t in mesh.axis_types],
            }
        ),
        "count": report.count,
        "bytes": report.bytes,
        "branched": report.branched,
        "by_kind": _totals(report.by_kind()),
        "by_axes": _totals(report.by_axes()),
        "by_phase": _totals(report.by_phase()),
        "rows": [_row(r) for r in report.rows],
        "rollup": report.rollup().to_dict(),
    }
    return json.dumps(data, indent=1)


def _totals(totals: dict) -> dict:
    return {k: {"count": t.count, "bytes": t.bytes} for k, t in totals.items()}


def _row(row: Any) -> dict:
    return {
        "name": row.name,
        "kind": row.kind,
        "axes": list(row.axes),
        "over": row.over,
        "group_size": row.group_size,
        "bytes": row.bytes,
        "executions": row.executions,
        "unknown_trips": row.unknown_trips,
        "phase": row.phase,
        "deferred": row.deferred,
        "branches": [
            {
                "conditional": b.conditional,
                "index": b.index,
                "count": b.count,
                "source": _source(b.source),
            }
            for b in row.branches
        ],  # fmt: skip
        "loops": [
            {
                "instruction": lp.instruction,
                "trips": lp.trips,
                "source": _source(lp.source),
            }
            for lp in row.loops
        ],  # fmt: skip
        "parts": [_part(p) for p in row.parts],
    }


def _part(part: Any) -> dict:
    return {
        "shape": part.shape,
        "before": part.before,
        "after": part.after,
        "bytes": part.bytes,
        "phase": part.phase,
        "path": ".".join(part.path),
        "op_name": part.op_name,
        "deferred": part.deferred,
        "no_collectives": sorted(part.no_collectives),
        "source": _source(part.source),
        "site": _site(part.site),
    }


def _source(source: Optional[Any]) -> Optional[dict]:
    if source is None:
        return None
    return {
        "file": source.file,
        "line": source.line,
        "text": source.text,
        "function": source.function,
        "annotated": source.annotated,
        "where": source.where,
        "frames": [
            {"file": os.path.basename(f.file), "function": f.function, "line": f.line}
            for f in source.frames
        ],
    }


def _site(site: Optional[Any]) -> Optional[dict]:
    if site is None:
        return None
    return {
        "file": site.file,
        "line": site.line,
        "text": site.text,
        "function": site.function,
        "annotated": site.annotated,
        "where": site.where,
        "via": list(site.via),
        "key": list(site.key),
    }
