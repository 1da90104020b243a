"""Where each instruction of a compiled module came from: its Python frames.

XLA's op metadata holds a `stack_frame_id`, an index into the module's
stack-frame tables (file names, function names, file locations, frames with
their parents). The text XLA prints gives the parent of a frame off by one
(and JAX 0.8 prints no ids at all), so the tables and ids are read from the
serialized `HloModuleProto` instead (`xla/service/hlo.proto`): a few fields,
decoded here without a protobuf library. JAX 0.8 writes ids that do not
match its tables, and the frame it takes for the user's inline
(`source_file`, `source_line`): that one frame is all that is read there.
"""

import linecache
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from .._core import compat as _compat
from .._core.site import is_library_file


@dataclass(frozen=True)
class Frame:
    """One Python frame of an instruction's stack."""

    file: str
    function: str
    line: int

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} ({self.function})"


# Field numbers of xla/service/hlo.proto and xla/xla_data.proto.
_MODULE_COMPUTATIONS, _MODULE_FRAMES = 3, 17
_COMPUTATION_NAME, _COMPUTATION_INSTRUCTIONS = 1, 2
_INSTRUCTION_NAME, _INSTRUCTION_METADATA = 1, 7
_METADATA_NAME, _METADATA_FILE, _METADATA_LINE, _METADATA_FRAME = 2, 3, 4, 15
_INDEX_FILES, _INDEX_FUNCTIONS, _INDEX_LOCATIONS, _INDEX_FRAMES = 1, 2, 3, 4


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, Any]]:
    """`(field number, value)` of a message: an int, or `(start, end)` of a
    length-delimited value (a string or a nested message)."""
    i = start
    while i < end:
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = (i, i + size), i + size
        elif wire == 5:
            value, i = None, i + 4
        elif wire == 1:
            value, i = None, i + 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield key >> 3, value


def _text(data: bytes, span: tuple[int, int]) -> str:
    return data[span[0] : span[1]].decode("utf-8", "replace")


def _message(data: bytes, span: tuple[int, int]) -> dict[int, Any]:
    """A nested message's fields (the last value of a repeated one)."""
    return dict(_fields(data, *span))


class Sources:
    """The frames of each instruction of one serialized module, by name: of the
    instructions of `computations` (all, if not given)."""

    def __init__(self, proto: bytes, computations: Optional[frozenset[str]] = None):
        self._metadata: dict[str, tuple[int, str, int]] = {}
        self._op_names: dict[str, str] = {}  # the op's JAX name stack
        files: list[str] = []
        functions: list[str] = []
        locations: list[dict[int, Any]] = []
        frames: list[dict[int, Any]] = []
        for field, value in _fields(proto, 0, len(proto)):
            if field == _MODULE_COMPUTATIONS:
                self._read_computation(proto, value, computations)
            elif field == _MODULE_FRAMES:
                for sub, item in _fields(proto, *value):
                    if sub == _INDEX_FILES:
                        files.append(_text(proto, item))
                    elif sub == _INDEX_FUNCTIONS:
                        functions.append(_text(proto, item))
                    elif sub == _INDEX_LOCATIONS:
                        locations.append(_message(proto, item))
                    elif sub == _INDEX_FRAMES:
                        frames.append(_message(proto, item))
        self._files, self._functions = files, functions
        self._locations, self._frames = locations, frames
        self._stacks: dict[int, tuple[Frame, ...]] = {}

    def _read_computation(
        self, proto: bytes, span: tuple[int, int], wanted: Optional[frozenset[str]]
    ) -> None:
        for field, value in _fields(proto, *span):
            if field == _COMPUTATION_NAME:
                if wanted is not None and _text(proto, value) not in wanted:
                    return  # its name comes first: the rest is skipped unread
                continue
            if field != _COMPUTATION_INSTRUCTIONS:
                continue
            name, metadata = None, None
            for sub, item in _fields(proto, *value):
                if sub == _INSTRUCTION_NAME:
                    name = _text(proto, item)
                elif sub == _INSTRUCTION_METADATA:
                    metadata = item
            if name is None or metadata is None:
                continue
            fields = _message(proto, metadata)
            file = fields.get(_METADATA_FILE)
            op_name = fields.get(_METADATA_NAME)
            if op_name is not None:
                self._op_names[name] = _text(proto, op_name)
            self._metadata[name] = (
                fields.get(_METADATA_FRAME) or 0,
                _text(proto, file) if file is not None else "",
                fields.get(_METADATA_LINE) or 0,
            )

    def stack(self, instruction: str) -> tuple[Frame, ...]:
        """The frames of an instruction, innermost first; `()` for none."""
        frame_id, file, line = self._metadata.get(instruction, (0, "", 0))
        if frame_id and _compat.hlo_stack_frames_usable():
            return self._stack(frame_id)
        # JAX 0.8: only the frame JAX took for the user's, inline.
        return (Frame(file, "", line),) if file else ()

    def op_name(self, instruction: str) -> str:
        """The op's name in the program JAX lowered (`jit(f)/scope/dot_general`:
        its named scopes), `""` for none."""
        return self._op_names.get(instruction, "")

    def op_names(self) -> Iterable[str]:
        """The op names of every instruction read."""
        return self._op_names.values()

    def op_name_for(self, collective: str, operand: str, graph: Any) -> str:
        """The op name of the instruction `stack_for` takes the frames of."""
        if len(graph.operands.get(collective, ())) > 1:
            found = self._nearest(operand, graph.operands, self.op_name)
            if found:
                return found
        return self._nearest(collective, graph.users, self.op_name)

    def stack_for(self, collective: str, operand: str, graph: Any) -> tuple[Frame, ...]:
        """The frames of one operand of a collective (`graph`: an `hlo.Graph`).

        A merged collective's operand: the nearest instruction above it with
        frames (a bitcast or copy may have none). Otherwise the collective's own.
        A collective with none of its own (JAX 0.12 gives one that moves a
        function's argument the argument's metadata, which has no frames): the
        nearest instruction using its result that has some; none (only the
        result tuple uses it): a layout XLA chose, `()`.
        """
        if len(graph.operands.get(collective, ())) > 1:
            found = self._nearest(operand, graph.operands)
            if found:
                return found
        return self._nearest(collective, graph.users)

    def _nearest(self, start: str, edges: dict, read: Any = None) -> Any:
        """The frames (or what `read` reads) of the nearest instruction from
        `start` (itself first) along `edges`, breadth first and a few steps,
        that has some."""
        read = self.stack if read is None else read
        frontier, seen = [start], {start}
        for _ in range(8):
            following = []
            for name in frontier:
                stack = read(name)
                if stack:
                    return stack
                for other in edges.get(name, ()):
                    if other not in seen:
                        seen.add(other)
                        following.append(other)
            frontier = following
        return read("")

    def stacks(self) -> list[tuple[Frame, ...]]:
        """Every stack of the module's frame table (each frame's, out to the
        outermost), innermost first: the calls of the whole program, fusions'
        ops included. `[]` where the tables are unusable (JAX 0.8)."""
        if not _compat.hlo_stack_frames_usable():
            return []
        return [self._stack(i) for i in range(1, len(self._frames) + 1)]

    def _stack(self, frame_id: int) -> tuple[Frame, ...]:
        known = self._stacks.get(frame_id)
        if known is not None:
            return known
        out = []
        current = frame_id
        # Ids are 1-based; a parent of 0 (absent) ends the stack. Bounded, in
        # case a table ever points in a circle.
        while 0 < current <= len(self._frames) and len(out) < len(self._frames):
            entry = self._frames[current - 1]
            location = _item(self._locations, entry.get(1, 0))
            file = _item(self._files, location.get(1, 0)) if location else None
            function = _item(self._functions, location.get(2, 0)) if location else None
            if location is None or file is None or function is None:
                break  # a table XLA wrote otherwise: stop there
            out.append(Frame(file, function, location.get(3, 0)))
            current = entry.get(2, 0)
        stack = self._stacks[frame_id] = tuple(out)
        return stack


def _item(table: list, one_based: int) -> Any:
    """`table[one_based - 1]`, or None for an id out of range (0: unset)."""
    return table[one_based - 1] if 0 < one_based <= len(table) else None


@dataclass(frozen=True)
class Source:
    """The user's line a collective's operand comes from."""

    file: str  # the file's name, without its directory
    line: int
    text: str  # the line, stripped ("" if the file cannot be read)
    function: str  # the function holding the line ("" if unknown: JAX 0.8)
    annotated: Optional[str]  # the nearest enclosing function whose hints are checked
    where: str  # "model.py: text" (with " #k" for a repeated text): stable across edits
    frames: tuple[Frame, ...]  # the user's frames, innermost first

    def __str__(self) -> str:
        """`model.py:74 in `einsum` within `mix`: y = jnp.einsum(...)`."""
        return located(self)


def located(at: Any) -> str:
    """A line as reports name it, from its `file`, `line`, `function`,
    `annotated` and `text`: `model.py:74 in `einsum` within `mix`: y = ...`."""
    where = f"{at.file}:{at.line}"
    if at.function:
        where += f" in `{at.function}`"
    if at.annotated is not None and at.annotated != at.function:
        where += f" within `{at.annotated}`"
    return f"{where}: {at.text}" if at.text else where


class Resolver:
    """Stacks to sources, with what one report asks many times cached."""

    def __init__(self) -> None:
        self._library: dict[str, bool] = {}
        self._lines: dict[tuple[str, int], tuple[str, str]] = {}
        self._sources: dict[tuple[Frame, ...], Optional[Source]] = {}

    def source(self, stack: tuple[Frame, ...]) -> Optional[Source]:
        """The first frame outside the libraries, and the nearest enclosing
        function whose annotations a checker checks (`jaxtyped`, `beartype`,
        `jts.jit`). `None` for an empty stack."""
        if stack in self._sources:
            return self._sources[stack]
        found = self._sources[stack] = self._resolve(stack) if stack else None
        return found

    def _resolve(self, stack: tuple[Frame, ...]) -> Source:
        user = [i for i, f in enumerate(stack) if not self._is_library(f.file)]
        first = stack[user[0]] if user else stack[0]
        annotated = next(
            (
                stack[i].function
                for i in user
                if i + 1 < len(stack) and _checks(stack[i + 1])
            ),
            None,
        )
        text, where = self._line(first.file, first.line)
        return Source(
            os.path.basename(first.file),
            first.line,
            text,
            first.function,
            annotated,
            where,
            tuple(stack[i] for i in user),
        )

    def user(self, stack: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """The frames of `stack` outside the libraries (as `Source.frames`)."""
        return tuple(f for f in stack if not self._is_library(f.file))

    def line(self, file: str, line: int) -> tuple[str, str]:
        """The text of a line and its stable name (`model.py: text #k`)."""
        return self._line(file, line)

    def _is_library(self, file: str) -> bool:
        known = self._library.get(file)
        if known is None:
            known = self._library[file] = is_library_file(file)
        return known

    def _line(self, file: str, line: int) -> tuple[str, str]:
        """The text of a line, and its stable name: `file: text`, plus `#k` when
        the same text is the k-th of several in the file."""
        key = (file, line)
        known = self._lines.get(key)
        if known is not None:
            return known
        name = os.path.basename(file)
        lines = linecache.getlines(file)
        if not 0 < line <= len(lines):
            found = ("", f"{name}:{line}")
        else:
            text = lines[line - 1].strip()
            same = [i for i, other in enumerate(lines, 1) if other.strip() == text]
            where = f"{name}: {text}"
            if len(same) > 1:
                where += f" #{same.index(line) + 1}"
            found = (text, where)
        self._lines[key] = found
        return found


def _checks(caller: Frame) -> bool:
    """Whether `caller` is a type checker's wrapper calling the function below."""
    return (
        # jaxtyping's `jaxtyped`, with a typechecker (`wrapped_fn_impl`) or with
        # `typechecker=None` over typeguard's `@typechecked` (`wrapped_fn`)
        caller.function.endswith(("wrapped_fn_impl", "jaxtyped.<locals>.wrapped_fn"))
        or caller.file.startswith("<@beartype(")  # beartype's generated wrapper
        or caller.function.endswith("checked.<locals>.make.<locals>.boundary")
    )
