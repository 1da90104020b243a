"""The collectives of a compiled module, read from its HLO text.

For each collective instruction reachable from the entry computation: its kind,
the operands it moves (their shapes), the device groups it runs over (as
partition ids: positions in the executable's device assignment), and how many
times one call of the program runs it (the trip counts of the `while` loops
around it, and which loops those are). Nothing here knows about meshes or
source lines.

The text is XLA's, which changes across releases (its device groups are read
in `groups.py`); an instruction whose groups cannot be read keeps
`groups=None` (reported, never dropped). Only the computations that run are
parsed: the bodies of fusions, most of the text, hold no collective.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from . import groups as _groups


# The kinds XLA emits (with `-start` for the asynchronous forms; `-done` halves
# move nothing and are skipped).
KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

_NUMPY = {"pred": "bool", "bf16": "bfloat16", "c64": "complex64", "c128": "complex128"}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9-]*)\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([^\]]*)\]")
_CALLS = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_NAME = re.compile(r"%?([\w.\-]+)")
_DIMENSIONS = re.compile(r"\bdimensions=\{(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class Operand:
    """What a collective moves for one of its operands."""

    name: str  # the instruction that defines it
    dtype: str  # XLA's element type, `f32`
    dims: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class Branch:
    """One branch of a `conditional` (a `lax.cond` or `lax.switch`): a call of
    the program runs one of its `count` branches, not all of them."""

    conditional: str  # the instruction
    index: int  # as `lax.switch` numbers them (a `lax.cond`: 0 false, 1 true)
    count: int


@dataclass(frozen=True)
class RawCollective:
    """One collective instruction, as the module says it."""

    name: str
    kind: str  # one of KINDS
    computation: str
    operands: tuple[Operand, ...]
    groups: _groups.Groups  # partition ids; None: unread
    pairs: tuple[tuple[int, int], ...]  # collective-permute's (source, target)
    executions: int  # per call of the program (trip counts multiplied)
    unknown_trips: bool  # inside a loop whose trip count XLA does not know
    branches: tuple[Branch, ...] = ()  # the conditionals around it, outermost first
    # The `while` loops around it (a `lax.scan`, `fori_loop`, `while_loop`),
    # outermost first: the instruction and its trip count (None: unknown).
    loops: tuple[tuple[str, Optional[int]], ...] = ()
    op: str = ""  # the JAX primitive it was lowered from (its `op_name`'s last)
    dimension: Optional[int] = None  # gathered / scattered / split (`dimensions=`)


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str


class _Module:
    """A module's text split into its computations, each parsed when first
    asked for: the bodies of fusions, most of the text, never are."""

    def __init__(self, text: str):
        self.entry: Optional[str] = None
        self._lines: dict[str, list[str]] = {}
        self._parsed: dict[str, list[Instruction]] = {}
        current: Optional[list[str]] = None
        for line in text.splitlines():
            if line.startswith((" ", "\t")):
                if current is not None:
                    current.append(line)
                continue
            header = _HEADER.match(line)
            current = None
            if header is not None:
                current = self._lines[header.group(2)] = []
                if header.group(1):
                    self.entry = header.group(2)

    def __contains__(self, name: str) -> bool:
        return name in self._lines

    def body(self, name: str) -> list[Instruction]:
        parsed = self._parsed.get(name)
        if parsed is None:
            found = (_instruction(line) for line in self._lines.get(name, ()))
            parsed = self._parsed[name] = [i for i in found if i is not None]
        return parsed


def _instruction(line: str) -> Optional[Instruction]:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match.group(2)
    opcode = _OPCODE.search(rest)
    if opcode is None:
        return None
    start = opcode.end()
    end = _groups.closing(rest, start - 1)
    return Instruction(
        match.group(1),
        rest[: opcode.start()].strip(),
        opcode.group(1),
        tuple(re.findall(r"%([\w.\-]+)", rest[start:end])),
        rest[end + 1 :],
    )


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """`[(dtype, dims), ...]` of a shape, a tuple's elements in order."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype == "token":
            continue
        sizes = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        out.append((dtype, sizes))
    return out


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    """The bytes of an XLA array: its type's bits (the number its name opens
    with: `s4`, `bf16`, `f4e2m1fn`, `c64`; `pred` a byte) per element, packed."""
    width = re.match(r"[a-z]+(\d+)", dtype)
    bits = 8 if width is None else int(width.group(1))
    return (math.prod(dims) * bits + 7) // 8


def jax_dtype(dtype: str) -> str:
    """XLA's element type in JAX's words (`f32` -> `float32`)."""
    if dtype in _NUMPY:
        return _NUMPY[dtype]
    match = re.fullmatch(r"([sufc])(\d+)(.*)", dtype)
    if match is None:
        return dtype
    kind = {"s": "int", "u": "uint", "f": "float", "c": "complex"}[match.group(1)]
    rest = match.group(3)
    return f"{kind}{match.group(2)}{'_' + rest if rest else ''}"


@dataclass(frozen=True)
class Graph:
    """Which instructions each one uses and is used by, by name, in the
    computations that run (`computations`: fusion bodies left out)."""

    operands: dict[str, tuple[str, ...]]
    users: dict[str, tuple[str, ...]]
    computations: frozenset[str] = frozenset()
    # The opcode of each (a `call`'s with its callee: `call:while.3_computation`).
    opcodes: dict[str, str] = field(default_factory=dict)

    def out_of_loop(self, name: str) -> bool:
        """Whether `name` is (a view of) a result of a `while` loop: what a
        loop carried out, the value a collective after the loop moves."""
        for _ in range(8):
            opcode = self.opcodes.get(name, "")
            if opcode == "while" or opcode.startswith("call:while"):
                return True
            if opcode not in _VIEWS or not self.operands.get(name):
                return False
            name = self.operands[name][0]
        return False


# Instructions that pass a value on unchanged (or one element of a tuple).
_VIEWS = frozenset({"bitcast", "copy", "get-tuple-element", "reshape", "transpose"})


def read(text: str) -> tuple[list[RawCollective], Graph]:
    """The collectives of the module reachable from its entry, and the graph of
    the computations that run them (to follow a collective's inputs back, or its
    result on)."""
    module = _Module(text)
    if module.entry is None:
        return [], Graph({}, {})
    runs, unknown, inside, loops = _executions(module, module.entry)
    operands: dict[str, tuple[str, ...]] = {}
    opcodes: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    found = []
    for computation in runs:
        body = module.body(computation)
        shapes = {i.name: i.shape for i in body}
        for instruction in body:
            operands[instruction.name] = instruction.operands
            opcodes[instruction.name] = instruction.opcode
            if instruction.opcode == "call":
                callee = _CALLS.search(instruction.attributes)
                if callee is not None:
                    opcodes[instruction.name] = f"call:{callee.group(2)}"
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction.name)
            kind = _kind(instruction.opcode)
            if kind is None:
                continue
            moved = tuple(
                Operand(name, dtype, dims, nbytes(dtype, dims))
                for name in instruction.operands
                for dtype, dims in arrays(shapes.get(name, ""))
            )
            found.append(
                RawCollective(
                    instruction.name,
                    kind,
                    computation,
                    moved,
                    _groups.groups(instruction.attributes),
                    _groups.pairs(instruction.attributes),
                    runs[computation],
                    computation in unknown,
                    inside.get(computation, ()),
                    loops.get(computation, ()),
                    _op(instruction.attributes),
                    _dimension(instruction.attributes),
                )
            )
    return found, Graph(
        operands, {k: tuple(v) for k, v in users.items()}, frozenset(runs), opcodes
    )


def _op(attributes: str) -> str:
    """The primitive of an instruction's `op_name` (`jit(step)/reshard`:
    `reshard`; JAX 0.8 repeats the path, `jit(f)/reshard/jit(f)/reshard`)."""
    found = _OP_NAME.search(attributes)
    return found.group(1).rpartition("/")[2] if found else ""


def _dimension(attributes: str) -> Optional[int]:
    """The dim an all-gather gathers, a reduce-scatter scatters, an all-to-all
    splits (`dimensions={0}`); None where the instruction says none."""
    found = _DIMENSIONS.search(attributes)
    return int(found.group(1)) if found else None


def _kind(opcode: str) -> Optional[str]:
    if opcode.endswith("-done"):
        return None
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


Loops = tuple[tuple[str, Optional[int]], ...]


def _executions(
    module: _Module, entry: str
) -> tuple[dict[str, int], set[str], dict[str, tuple[Branch, ...]], dict[str, Loops]]:
    """How many times one call runs each computation reachable from the entry
    (`while` bodies: their known trip count; each branch of a `conditional` as
    if it ran, which one call runs at most), those inside a loop of unknown trip
    count (counted once), the conditionals' branches each one is in, and the
    `while` loops whose body (or condition) it runs in."""
    runs: dict[str, int] = {}
    unknown: set[str] = set()
    inside: dict[str, tuple[Branch, ...]] = {}
    looped: dict[str, Loops] = {}
    stack: list[tuple[str, int, bool, tuple[Branch, ...], Loops]] = [
        (entry, 1, False, (), ())
    ]
    while stack:
        computation, times, loose, branches, loops = stack.pop()
        runs[computation] = runs.get(computation, 0) + times
        looped.setdefault(computation, loops)
        # Reached by several paths (XLA gives each call site its own copy, so
        # rarely): inside only the conditionals all of them are inside.
        seen = inside.setdefault(computation, branches)
        if seen != branches:
            common = next(
                (i for i, (a, b) in enumerate(zip(seen, branches)) if a != b),
                min(len(seen), len(branches)),
            )
            inside[computation] = seen[:common]
        if loose:
            unknown.add(computation)
        for instruction in module.body(computation):
            if instruction.opcode == "fusion":
                continue  # a fusion's body holds no collective
            callees = [
                (c, 1 if what == "true_computation" else 0)
                for what, c in _CALLS.findall(instruction.attributes)
            ]
            for listed in _BRANCHES.findall(instruction.attributes):
                callees += [(c, k) for k, c in enumerate(_NAME.findall(listed))]
            factor, inner_loose, within_loops = 1, loose, loops
            if instruction.opcode == "while":
                trip = _TRIP.search(instruction.attributes)
                if trip is None:
                    inner_loose = True
                else:
                    factor = int(trip.group(1))
                count = None if trip is None else factor
                within_loops = (*loops, (instruction.name, count))
            if instruction.opcode not in ("while", "call", "conditional") and not (
                instruction.opcode.startswith("async")
            ):
                continue  # `to_apply` of a reduction: a scalar function
            for callee, index in callees:
                if callee not in module:
                    continue
                within = branches
                if instruction.opcode == "conditional":
                    branch = Branch(instruction.name, index, len(callees))
                    within = (*branches, branch)
                stack.append(
                    (callee, times * factor, inner_loose, within, within_loops)
                )
    return runs, unknown, inside, looped
