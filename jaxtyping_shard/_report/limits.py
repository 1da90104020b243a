"""`preflight`'s budgets: `hbm_bytes=` (the bytes a device holds: arguments,
results and, where XLA's compile on the production mesh gave them, temporaries)
and `max_replicated=` (the bytes of the leaves whole on every device: a float, a
fraction of the bytes per device; an int, bytes; MaxText's `sharding_tolerance`).
Each one exceeded fails the preflight, naming the largest leaves."""

from typing import Any, Optional, Union

from .memory import PreflightReport
from .text import format_bytes


_SHOWN = 5


def hbm_budget(hbm_bytes: Any) -> Optional[int]:
    if hbm_bytes is not None and (
        isinstance(hbm_bytes, bool) or not isinstance(hbm_bytes, int) or hbm_bytes <= 0
    ):
        raise ValueError(
            f"preflight: hbm_bytes is a number of bytes per device (an int > 0, "
            f"e.g. `16 * 2**30`), not {hbm_bytes!r}."
        )
    return hbm_bytes


def replicated_budget(max_replicated: Any) -> Optional[Union[int, float]]:
    value = max_replicated
    fraction = isinstance(value, float) and 0.0 <= value <= 1.0
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if value is not None and not (fraction or count):
        raise ValueError(
            "preflight: max_replicated is a fraction of the bytes per device (a "
            "float from 0.0 to 1.0, e.g. `0.02`) or a number of bytes per device "
            f"(an int >= 0, e.g. `64 * 2**20`), not {value!r}."
        )
    return value


def over_lines(head: str, report: PreflightReport) -> list[str]:
    """The error's lines for each budget `report` exceeds (none: `[]`)."""
    lines: list[str] = []
    if report.over_budget:
        lines += _over_hbm(head, report)
    if report.over_replicated:
        lines += _over_replicated(head, report)
    return lines


def _over_hbm(head: str, report: PreflightReport) -> list[str]:
    assert report.hbm_bytes is not None
    temporaries = report.temporary_bytes
    counted = (
        f" + temporaries {format_bytes(temporaries)}, less donated arguments, "
        "as XLA counts them"
        if temporaries is not None
        else "; temporaries not counted: check_mesh='cpu' compiles the step on "
        "this mesh to count them"
    )
    needed = report.budget_bytes
    lines = [
        f"{head}: {format_bytes(needed)} per device (arguments "
        f"{format_bytes(report.argument_bytes)} + outputs "
        f"{format_bytes(report.output_bytes)}{counted}) is over the budget "
        f"hbm_bytes={format_bytes(report.hbm_bytes)} ({report.hbm_bytes} bytes). "
        "Largest per device:"
    ]
    for leaf in report.largest(_SHOWN):
        lines.append(
            f"  {leaf.path}: {leaf.array}, {format_bytes(leaf.bytes_per_device)}"
        )
    for temporary in (report.temporaries or ())[:_SHOWN]:
        lines.append(
            f"  temporary at {temporary.where}: "
            f"{format_bytes(temporary.largest_bytes)} (its largest of "
            f"{temporary.buffers} buffers)"
        )
    lines.append(
        "Shard the largest over more mesh axes (their annotations, or the rules "
        "table), rematerialise what the temporaries keep (`jax.checkpoint`), or "
        "give each device more memory."
    )
    return lines


def _over_replicated(head: str, report: PreflightReport) -> list[str]:
    limit = report.max_replicated
    assert limit is not None
    allowed = report.replicated_allowance
    said = (
        f"{limit:g} of {format_bytes(report.total_bytes)} per device = "
        f"{format_bytes(allowed)}"
        if isinstance(limit, float)
        else f"{format_bytes(allowed)}"
    )
    replicated = report.replicated
    lines = [
        f"{head}: {len(replicated)} leaves whole on every device take "
        f"{format_bytes(report.replicated_bytes)} per device, over "
        f"max_replicated={limit!r} ({said}). Largest replicated:"
    ]
    for leaf in replicated[:_SHOWN]:
        lines.append(
            f"  {leaf.path}: {leaf.array}, {format_bytes(leaf.bytes_per_device)}"
        )
    lines.append(
        "Shard them over a mesh axis (their annotations, or the rules table), or "
        "raise max_replicated."
    )
    return lines
