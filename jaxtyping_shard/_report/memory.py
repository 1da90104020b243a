"""What `preflight` reports: the bytes each device holds for a step's arguments
and results, leaf by leaf and grouped, and what was and was not checked.

The bytes of each leaf come from its shape, dtype and layout (its annotation's,
else the one the trace gives it) through `explain`'s arithmetic (`sizes.shard_bytes`).
"""

import dataclasses
from typing import Any, NamedTuple, Optional

from jax.sharding import PartitionSpec

from .._core import mesh as _mesh
from .._layout import spec as _spec
from .sizes import shard_bytes
from .text import format_bytes


class LeafBytes(NamedTuple):
    """One array of a step's arguments or results, as `preflight` counts it."""

    group: str  # the argument ("params"), or "outputs"
    path: str  # "params.blocks[0].attn.wq", "outputs[0].embed"
    top: str  # its tree's top level: "params.blocks", "outputs[0]"
    shape: tuple
    dtype: Any
    spec: Optional[PartitionSpec]  # None: not known until XLA compiles
    annotated: bool  # whether its annotation has a sharding (and was checked)
    shard_shape: Optional[tuple]
    bytes_per_device: Optional[int]
    bytes_replicated: Optional[int]  # stored beyond one copy, mesh-wide

    @property
    def array(self) -> str:
        """The leaf in JAX's notation (`float32[4096@data,32@model,128]`)."""
        if self.spec is None:
            return _spec.format_array(self.dtype, self.shape, ()) + " (layout ?)"
        entries = _spec.entries_of(self.spec)
        return _spec.format_array(self.dtype, self.shape, entries, self.spec)

    @property
    def replicated(self) -> bool:
        """Whole on every device: its layout shards nothing, on several devices."""
        return (
            self.spec is not None
            and not any(_spec.entries_of(self.spec))
            and not _spec.unreduced_axes(self.spec)
            and bool(self.bytes_replicated)
        )


def leaf_bytes(
    group: str, path: str, top: str, leaf: Any, spec: Any, annotated: bool, mesh: Any
) -> LeafBytes:
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    entries = _spec.entries_of(spec) if spec is not None else None
    if entries is None:
        shard = per = replicated = None
    else:
        unreduced = _spec.unreduced_axes(spec)
        shard, per, replicated = shard_bytes(shape, dtype, entries, mesh, unreduced)
    return LeafBytes(
        group, path, top, shape, dtype, spec, annotated, shard, per, replicated
    )


@dataclasses.dataclass(frozen=True)
class Checks:
    """What `preflight` checked, and what it could not."""

    traced_on: str  # the mesh the step was traced on
    leaves_checked: int  # argument and result leaves with a sharded annotation
    unannotated: tuple[str, ...]  # leaves with no sharding in their annotation
    compile_time: int  # checks that wait for XLA (Auto axes), scheduled
    compiled_on: Optional[str]  # the mesh they ran on (`check_mesh`), or None
    not_checked: tuple[str, ...]  # each thing not checked, in words

    @property
    def complete(self) -> bool:
        """Whether every check the library would run on the mesh ran."""
        return not self.not_checked


class PreflightReport:
    """What [`jaxtyping_shard.preflight`][] returns: bytes per device, and checks.

    Printed, a table; as data: `.leaves` (one `LeafBytes` per argument and result
    leaf: `group`, `path`, `top`, `shape`, `dtype`, `spec`, `annotated`,
    `shard_shape`, `bytes_per_device`, `bytes_replicated`), the totals and
    groupings below, and `.checks` (what was and was not checked).
    """

    def __init__(
        self,
        name: str,
        mesh: Any,
        leaves: list[LeafBytes],
        checks: Checks,
        hbm_bytes: Optional[int] = None,
    ):
        self.name = name
        self.mesh = mesh
        self.leaves: tuple[LeafBytes, ...] = tuple(leaves)
        self.checks = checks
        self.hbm_bytes = hbm_bytes
        # XLA's `memory_analysis()` when the step was compiled on the mesh itself
        # (a concrete mesh, or check_mesh="cpu"), temporaries included; else None.
        self.xla_memory: Any = None
        self.max_replicated: Any = None  # a fraction (float) or bytes (int)
        # Temporaries by source line, largest first (check_mesh="cpu"), and the
        # step's collectives at the real group sizes; None where not compiled.
        self.temporaries: Optional[list] = None
        self.collectives: Any = None
        # check_mesh="cpu": "one process" (the mesh itself) or "folded"; else None.
        self.check_mesh_method: Optional[str] = None

    @property
    def temporary_bytes(self) -> Optional[int]:
        """XLA's temporaries per device, when the step was compiled on the
        production mesh (itself concrete, or `check_mesh="cpu"`); else None."""
        memory = self.xla_memory
        return None if memory is None else int(memory.temp_size_in_bytes)

    @property
    def peak_bytes(self) -> Optional[int]:
        """Arguments + results + temporaries - donated arguments per device, as
        XLA's `memory_analysis()` counts them; None where temporaries are unknown.
        (XLA's own `peak_memory_in_bytes` leaves the temporaries out on CPU.)"""
        memory = self.xla_memory
        if memory is None:
            return None
        return int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )

    @property
    def budget_bytes(self) -> int:
        """What `hbm_bytes` is compared with: `peak_bytes` where known, else
        `total_bytes` (temporaries not counted)."""
        peak = self.peak_bytes
        return self.total_bytes if peak is None else peak

    @property
    def replicated_bytes(self) -> int:
        """Bytes per device of the leaves whole on every device."""
        return sum(leaf.bytes_per_device or 0 for leaf in self.replicated)

    @property
    def replicated_allowance(self) -> Optional[int]:
        """The bytes `max_replicated` allows per device (a float: that fraction
        of `total_bytes`), or None."""
        limit = self.max_replicated
        if isinstance(limit, float):
            return int(limit * self.total_bytes)
        return limit

    @property
    def over_replicated(self) -> bool:
        allowed = self.replicated_allowance
        return allowed is not None and self.replicated_bytes > allowed

    def _total(self, outputs: Optional[bool]) -> int:
        return sum(
            leaf.bytes_per_device or 0
            for leaf in self.leaves
            if outputs is None or (leaf.group == "outputs") == outputs
        )

    @property
    def argument_bytes(self) -> int:
        """Bytes per device of the arguments (of the leaves whose layout is known)."""
        return self._total(False)

    @property
    def output_bytes(self) -> int:
        """Bytes per device of the results (of the leaves whose layout is known).

        On CPU, XLA's `memory_analysis().output_size_in_bytes` is this for one
        result leaf, and this plus 8 bytes per leaf for several: the result
        tuple's table of buffer pointers."""
        return self._total(True)

    @property
    def total_bytes(self) -> int:
        """Arguments plus results, per device: what `hbm_bytes` is compared with."""
        return self._total(None)

    @property
    def bytes_per_device(self) -> int:
        """`total_bytes`, named as `Explanation`'s total is."""
        return self.total_bytes

    @property
    def rows(self) -> tuple[LeafBytes, ...]:
        """`leaves`, named as `Explanation`'s rows are."""
        return self.leaves

    @property
    def unknown(self) -> tuple[LeafBytes, ...]:
        """Leaves whose layout is not known before XLA compiles (not counted)."""
        return tuple(leaf for leaf in self.leaves if leaf.bytes_per_device is None)

    def by_argument(self) -> dict[str, int]:
        """Bytes per device per argument, and `"outputs"`."""
        return _grouped(self.leaves, lambda leaf: leaf.group)

    def by_top_level(self) -> dict[str, int]:
        """Bytes per device per top level of each tree (`params.blocks`,
        `opt.mu`, `outputs[0]`)."""
        return _grouped(self.leaves, lambda leaf: leaf.top)

    def largest(self, n: int = 10) -> list[LeafBytes]:
        """The `n` leaves that take the most bytes per device."""
        known = [leaf for leaf in self.leaves if leaf.bytes_per_device is not None]
        return sorted(known, key=lambda leaf: -(leaf.bytes_per_device or 0))[:n]

    @property
    def replicated(self) -> tuple[LeafBytes, ...]:
        """The leaves whole on every device, largest first."""
        found = [leaf for leaf in self.leaves if leaf.replicated]
        return tuple(sorted(found, key=lambda leaf: -(leaf.bytes_per_device or 0)))

    @property
    def over_budget(self) -> bool:
        return self.hbm_bytes is not None and self.budget_bytes > self.hbm_bytes

    def as_dict(self) -> dict:
        """The report as plain data (JSON-ready)."""
        return {
            "function": self.name,
            "mesh": _mesh.format_mesh(self.mesh),
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "total_bytes": self.total_bytes,
            "hbm_bytes": self.hbm_bytes,
            "temporary_bytes": self.temporary_bytes,
            "check_mesh_method": self.check_mesh_method,
            "peak_bytes": self.peak_bytes,
            "max_replicated": self.max_replicated,
            "replicated_bytes": self.replicated_bytes,
            "temporaries": [
                {
                    "where": t.where,
                    "largest_bytes": t.largest_bytes,
                    "buffers": t.buffers,
                }
                for t in self.temporaries or ()
            ],
            "by_argument": self.by_argument(),
            "by_top_level": self.by_top_level(),
            "leaves": [
                {
                    "path": leaf.path,
                    "array": leaf.array,
                    "shard_shape": leaf.shard_shape,
                    "bytes_per_device": leaf.bytes_per_device,
                    "bytes_replicated": leaf.bytes_replicated,
                    "annotated": leaf.annotated,
                }
                for leaf in self.leaves
            ],
            "checks": dataclasses.asdict(self.checks),
        }

    def __str__(self) -> str:
        lines = [self.headline()]
        lines += _table(
            ("argument", "bytes/device", "bytes replicated (mesh-wide)"),
            [
                (group, format_bytes(per), format_bytes(_replicated(self, group)))
                for group, per in self.by_argument().items()
            ],
        )
        lines += _table(
            ("top level", "bytes/device"),
            [(top, format_bytes(per)) for top, per in self.by_top_level().items()],
        )
        lines += _table(
            ("largest leaves", "layout", "shard/device", "bytes/device"),
            [_leaf_cells(leaf) for leaf in self.largest(_SHOWN)],
        )
        replicated = self.replicated
        rows = [(r.path, r.array, format_bytes(r.bytes_per_device)) for r in replicated]
        if len(rows) > _SHOWN:
            rest = replicated[_SHOWN:]
            total = format_bytes(sum(r.bytes_per_device or 0 for r in rest))
            rows = rows[:_SHOWN] + [(f"... and {len(rest)} more", "", total)]
        lines += _table(
            ("replicated (whole on every device)", "layout", "bytes/device"),
            rows or [("none", "", "")],
        )
        if self.temporaries:
            lines += _table(
                ("largest temporaries (by line)", "largest buffer", "buffers"),
                [
                    (t.where, format_bytes(t.largest_bytes), str(t.buffers))
                    for t in self.temporaries[:_SHOWN]
                ],
            )
        lines.append("")
        lines.append(self.checked_text())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def headline(self) -> str:
        budget = ""
        temporaries = self.temporary_bytes
        if temporaries is not None:
            budget = (
                f"; with XLA's temporaries {format_bytes(temporaries)}, the peak "
                f"is {format_bytes(self.peak_bytes)}"
            )
        elif self.hbm_bytes is not None:
            budget = " (temporaries not counted: check_mesh='cpu' compiles them)"
        if self.hbm_bytes is not None:
            verdict = "OVER" if self.over_budget else "within"
            budget += f", {verdict} the budget of {format_bytes(self.hbm_bytes)}"
        unknown = self.unknown
        lower = (
            f" (at least: {len(unknown)} leaves of unknown layout)" if unknown else ""
        )
        return (
            f"preflight of `{self.name}` on mesh {_mesh.format_mesh(self.mesh)}: "
            f"{format_bytes(self.total_bytes)} per device{lower} = arguments "
            f"{format_bytes(self.argument_bytes)} + outputs "
            f"{format_bytes(self.output_bytes)}{budget}"
        )

    def checked_text(self) -> str:
        checks = self.checks
        lines = [
            f"checked: {checks.leaves_checked} annotated argument and result leaves, "
            f"and every check inside `{self.name}`, traced on {checks.traced_on}"
            + (
                f"; {checks.compile_time} compile-time checks (Auto axes) compiled on "
                f"{checks.compiled_on}"
                if checks.compiled_on is not None and checks.compile_time
                else ""
            )
        ]
        if checks.unannotated:
            shown = ", ".join(checks.unannotated[:8])
            more = len(checks.unannotated) - 8
            lines.append(
                f"no sharding annotated (not checked): {len(checks.unannotated)} "
                f"leaves: {shown}" + (f", and {more} more" if more > 0 else "")
            )
        for item in checks.not_checked:
            lines.append(f"NOT CHECKED: {item}")
        return "\n".join(lines)

    def leaves_table(self) -> str:
        """Every argument and result leaf, one row each."""
        return "\n".join(
            _table(
                ("path", "layout", "shard/device", "bytes/device"),
                [_leaf_cells(leaf) for leaf in self.leaves],
            )[1:]
        )


PreflightReport.__module__ = "jaxtyping_shard"
_SHOWN = 10  # rows of the largest and of the replicated leaves in the table


def _grouped(leaves: Any, key: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for leaf in leaves:
        out[key(leaf)] = out.get(key(leaf), 0) + (leaf.bytes_per_device or 0)
    return out


def _replicated(report: PreflightReport, group: str) -> int:
    return sum(
        leaf.bytes_replicated or 0 for leaf in report.leaves if leaf.group == group
    )


def _leaf_cells(leaf: LeafBytes) -> tuple:
    shard = "?" if leaf.shard_shape is None else "x".join(map(str, leaf.shard_shape))
    return (leaf.path, leaf.array, shard or "()", format_bytes(leaf.bytes_per_device))


def _table(head: tuple, rows: list) -> list[str]:
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [""]
    for i, cells in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines
