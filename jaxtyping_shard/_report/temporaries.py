"""A compiled step's temporaries per device, by source line: read from XLA's
buffer assignment (`memory_analysis().serialized_buffer_assignment_proto`).

A temporary is a buffer of an allocation that is neither an entry parameter, a
result (`maybe_live_out`), a constant nor thread-local: their allocations add up
to `temp_size_in_bytes`. Each buffer is defined by one instruction (by its id);
the instruction's Python frames come from the module's tables (`sources`).
Buffers share their allocation's bytes over time, so the buffers of a line say
which lines hold the largest arrays, not how much of the peak each line takes.

The fields are read without a protobuf library, as `sources` reads the module
(`xla/service/hlo.proto`: `BufferAssignmentProto`, `HloModuleProto`).
"""

import dataclasses
from typing import Any, NamedTuple, Optional

from . import sources as _sources
from .sources import Resolver, Source, Sources


# BufferAssignmentProto: logical_buffers = 1, buffer_allocations = 3.
_LOGICAL, _ALLOCATIONS = 1, 3
_BUFFER_ID, _BUFFER_SIZE, _BUFFER_AT, _AT_INSTRUCTION = 1, 2, 3, 4
_ALLOC_SIZE, _THREAD_LOCAL, _PARAMETER, _LIVE_OUT, _ASSIGNED, _CONSTANT = (
    2,
    3,
    5,
    7,
    9,
    12,
)
_ASSIGNED_BUFFER, _ASSIGNED_SIZE = 1, 3
# HloModuleProto: computations = 3; HloComputationProto: instructions = 2;
# HloInstructionProto: name = 1, id = 35.
_COMPUTATIONS, _INSTRUCTIONS, _NAME, _ID = 3, 2, 1, 35


class Temporary(NamedTuple):
    """The temporaries one source line (or one instruction, with no line) defines."""

    where: str  # "model.py:40 in `mlp`: h = x @ w", or the instruction's name
    largest_bytes: int  # its largest temporary buffer, per device
    buffers: int  # how many temporary buffers it defines
    instruction: str  # the instruction of the largest
    source: Optional[Source]


@dataclasses.dataclass(frozen=True)
class XlaMemory:
    """XLA's `memory_analysis()` of a compile, as plain data (per device)."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int
    # XLA's own figure; on CPU it leaves the temporaries out.
    peak_memory_in_bytes: Optional[int]

    @classmethod
    def of(cls, stats: Any) -> "XlaMemory":
        names = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {n: getattr(stats, n, None) for n in names}
        return cls(**values)

    @property
    def peak_bytes(self) -> int:
        """Arguments + results + temporaries, less donated arguments."""
        return (
            self.argument_size_in_bytes
            + self.output_size_in_bytes
            + self.temp_size_in_bytes
            - self.alias_size_in_bytes
        )


def by_line(compiled: Any, n: int = 10) -> Optional[list[Temporary]]:
    """The `n` source lines whose temporaries are the largest, largest first;
    None when XLA gives no buffer assignment."""
    stats = compiled.memory_analysis()
    proto = getattr(stats, "serialized_buffer_assignment_proto", None)
    if not proto:
        return None
    modules = compiled.runtime_executable().hlo_modules()
    module = modules[0].as_serialized_hlo_module_proto()
    names = _instruction_names(module)
    sources = Sources(module)
    resolver = Resolver()
    found: dict[str, list] = {}
    for name, size in _temporary_buffers(proto, names):
        source = resolver.source(sources.stack(name))
        where = str(source) if source is not None else name
        entry = found.setdefault(where, [0, 0, name, source])
        entry[1] += 1
        if size > entry[0]:
            entry[0], entry[2] = size, name
    rows = [Temporary(w, e[0], e[1], e[2], e[3]) for w, e in found.items()]
    return sorted(rows, key=lambda t: (-t.largest_bytes, t.where))[:n]


def _instruction_names(module: bytes) -> dict[int, str]:
    names: dict[int, str] = {}
    for field, span in _sources._fields(module, 0, len(module)):
        if field != _COMPUTATIONS:
            continue
        for sub, item in _sources._fields(module, *span):
            if sub != _INSTRUCTIONS:
                continue
            fields = _sources._message(module, item)
            if _NAME in fields and _ID in fields:
                names[fields[_ID]] = _sources._text(module, fields[_NAME])
    return names


def _temporary_buffers(proto: bytes, names: dict[int, str]) -> list[tuple[str, int]]:
    """`(defining instruction, bytes)` of every buffer of a temporary allocation."""
    defined: dict[int, int] = {}
    temporary: list[tuple[int, int]] = []
    for field, span in _sources._fields(proto, 0, len(proto)):
        if field == _LOGICAL:
            fields = _sources._message(proto, span)
            at = fields.get(_BUFFER_AT)
            if at is not None:
                where = _sources._message(proto, at).get(_AT_INSTRUCTION, 0)
                defined[fields.get(_BUFFER_ID, 0)] = where
        elif field == _ALLOCATIONS:
            flags: dict[int, Any] = {}
            assigned = []
            for sub, item in _sources._fields(proto, *span):
                if sub == _ASSIGNED:
                    assigned.append(_sources._message(proto, item))
                else:
                    flags[sub] = item
            if any(flags.get(k) for k in (_THREAD_LOCAL, _PARAMETER, _LIVE_OUT)):
                continue
            if flags.get(_CONSTANT):
                continue
            for a in assigned:
                temporary.append((a.get(_ASSIGNED_BUFFER, 0), a.get(_ASSIGNED_SIZE, 0)))
    return [
        (names.get(defined.get(buffer, -1), f"buffer {buffer}"), size)
        for buffer, size in temporary
    ]
