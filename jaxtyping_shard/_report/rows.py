"""The rows of a `collectives` report: each collective of a compiled step
(`Collective`), its operands (`Part`, with the line and call site that made
each), the conditional branches (`Branch`) and loops (`Loop`) around it, and
the totals (`Total`) by kind and by axes.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

from .call_sites import CallSite
from .sources import Source


class Part(NamedTuple):
    """One array a collective moves (several when XLA merged collectives)."""

    shape: str  # as JAX prints it: `float32[64,32]`, the operand on each device
    bytes: int  # each device receives (and sends), over one call of the step
    source: Optional[Source]  # None: XLA added it for a layout (no source)
    # The call site that tells it apart from the report's other parts (its row
    # and baseline key: `call_sites.py`); None: no source.
    site: Optional[CallSite] = None
    # The axes `jts.no_collectives` forbids where it was made.
    no_collectives: frozenset[str] = frozenset()
    deferred: bool = False  # a value unreduced over its axes: `Collective.role`
    # The op's name in the compiled program (JAX's name stack, transforms and
    # named scopes: `jit(step)/transpose(jvp(...))/dot_general`), `""` for none.
    op_name: str = ""
    phase: str = "forward"  # `forward`, `backward` or `other` (`rollup.py`)
    # The operand's layout before and after, in JAX's notation (`operand_layout.py`):
    # `float32[8@data,4]` -> `float32[8,4]` for an all-gather over `data`.
    before: str = ""
    after: str = ""
    # Its module path from the step (`("blocks[*]", "attn")`; `rollup.py`).
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Branch:
    """A branch of a `lax.cond` / `lax.switch` (an HLO `conditional`): a
    collective in it runs at most as counted."""

    conditional: str  # the HLO instruction
    index: int  # as `lax.switch` numbers them (`lax.cond`: 0 false, 1 true)
    count: int  # branches
    source: Optional[Source]  # the line of the `lax.cond` / `lax.switch`

    def __str__(self) -> str:
        at = f"{self.source.file}:{self.source.line}" if self.source else "?"
        return f"branch {self.index} of {self.count} of the conditional at {at}"


@dataclass(frozen=True)
class Loop:
    """A `while` loop around a collective (a `lax.scan`): it runs once a trip."""

    instruction: str  # the HLO `while`
    trips: Optional[int]  # None: XLA knows no trip count
    source: Optional[Source]  # the line of the `lax.scan` / loop

    def __str__(self) -> str:
        at = f"{self.source.file}:{self.source.line}" if self.source else "?"
        return f"the loop at {at} ({self.trips or 'unknown'} trips)"


class Collective(NamedTuple):
    """One collective instruction of the compiled program."""

    kind: str  # `all-gather`, `all-reduce`, `reduce-scatter`, `all-to-all`, ...
    axes: tuple[str, ...]  # the mesh axes it runs over
    over: str  # the axes in words: `data`, `data+model`, `data (2 of 4)`
    group_size: int  # devices per group
    bytes: int  # each device receives (and sends), over one call: all parts
    executions: int  # times one call runs it (loop trip counts multiplied)
    parts: tuple[Part, ...]
    name: str  # the HLO instruction
    unknown_trips: bool = False  # in a loop XLA knows no trip count of: one run
    # The conditionals around it, outermost first (`executions`, `bytes`: a
    # call that takes its branch), and the `while` loops (`()`: once a call).
    branches: tuple[Branch, ...] = ()
    loops: tuple[Loop, ...] = ()

    @property
    def phase(self) -> str:
        """`forward`, `backward` or `other`, that of its parts (`Part.phase`);
        `mixed` when XLA merged parts of several passes."""
        found = {p.phase for p in self.parts}
        return found.pop() if len(found) == 1 else "mixed" if found else "other"

    @property
    def deferred(self) -> bool:
        """Whether it reduces a value unreduced over its (`Explicit`) axes: the
        sum `unreduced` deferred (JAX's `reshard` of it, or a loop's carry)."""
        return any(p.deferred for p in self.parts)

    @property
    def in_loop(self) -> bool:
        """Whether it runs inside a `while` loop (per micro-batch, per layer)."""
        return bool(self.loops)

    @property
    def role(self) -> str:
        """`deferred reduction of unreduced over data`, or `""`."""
        if not self.deferred:
            return ""
        if not all(p.deferred for p in self.parts):
            return f"with a deferred reduction of unreduced over {self.over or '?'}"
        return f"deferred reduction of unreduced over {self.over or '?'}"

    @property
    def layout_only(self) -> bool:
        """Added by XLA for an input's or output's layout: no source line."""
        return all(p.source is None for p in self.parts)

    @property
    def merged(self) -> bool:
        """Several operands in one instruction (XLA may merge collectives)."""
        return len(self.parts) > 1

    @property
    def sites(self) -> tuple[CallSite, ...]:
        """Each distinct call site of its parts, in order (`call_sites.py`)."""
        seen: dict[tuple, CallSite] = {}
        for part in self.parts:
            if part.site is not None:
                seen.setdefault(
                    (part.site.file, part.site.line, part.site.key), part.site
                )
        return tuple(seen.values())

    @property
    def sources(self) -> tuple[Source, ...]:
        """Each distinct source line of its parts, in order (a line reached
        through several calls, once)."""
        seen: dict[str, Source] = {}
        for part in self.parts:
            if part.source is not None:
                seen.setdefault(str(part.source), part.source)
        return tuple(seen.values())


@dataclass(frozen=True)
class Total:
    """Collectives of one kind (or over one set of axes), per call of the step."""

    count: int  # collectives run
    bytes: int  # each device receives (and sends)
