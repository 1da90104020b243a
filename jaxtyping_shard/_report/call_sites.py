"""Call sites: which line of the user's code a collective's operand belongs to
when the line that made it is a helper's, shared by several callers.

The rule: each part of a report has the chain of the user's frames its operand
was made under, innermost first (`Source.frames`). Its call site is the
shortest inner run of that chain after which no other chain of the program
(those of every op of the compiled module, not only of the collectives) goes
on to another caller: the innermost frame when no other chain passes through it; a
helper's line (`return jnp.einsum(...)` in `dense`) used from six lines gives
six call sites, each the frame calling the helper (or, for a helper called
through another helper, the first frame out where the chains part). Frames
further out that every chain shares (the step's caller) are never part of it.
A site reached through a loop over layers is one site (the same lines). The
site's line is the row's line; its key, in a baseline, is the site's line and
the helpers' lines inside it, each named by its file and stripped text.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from .sources import Frame, located, Resolver, Source


@dataclass(frozen=True)
class CallSite:
    """The call site of a part: the user's line that tells it apart, and the
    helpers' frames inside it (innermost first; `()` when the line that made
    the operand is the site itself)."""

    file: str  # the site's file, without its directory
    line: int
    text: str  # the site's line, stripped ("" if the file cannot be read)
    function: str  # the function holding the site's line ("" if unknown: JAX 0.8)
    annotated: Optional[str]  # the nearest enclosing annotated function
    where: str  # "model.py: text" (with " #k" for a repeated text)
    helpers: tuple[Frame, ...]  # the frames inside the helpers, innermost first
    via: tuple[str, ...]  # their lines, named as `where` is

    @property
    def key(self) -> tuple[str, ...]:
        """What a baseline keys the site by: its line, then the helpers' lines
        from the outermost helper in."""
        return (self.where, *reversed(self.via))

    def __str__(self) -> str:
        """`model.py:40 in `ffn`: h = dense(x, w1) (via `dense` at model.py:8)`."""
        said = located(self)
        if self.helpers:
            inner = ", ".join(
                f"`{f.function}` at {os.path.basename(f.file)}:{f.line}"
                if f.function
                else f"{os.path.basename(f.file)}:{f.line}"
                for f in reversed(self.helpers)
            )
            said += f" (via {inner})"
        return said


def chain(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """A stack's user frames as the rule reads them: each frame once, where it
    first appears (innermost). JAX repeats the frames of a nested trace
    (`a, b, c, a, b, c, d` under `value_and_grad` and `scan`): the same call."""
    seen: set[Frame] = set()
    out = []
    for frame in frames:
        if frame not in seen:
            seen.add(frame)
            out.append(frame)
    return tuple(out) if len(out) < len(frames) else frames


def depths(chains: Iterable[tuple[Frame, ...]]) -> dict[tuple[Frame, ...], int]:
    """For each distinct chain (innermost first), how many of its frames make
    its call site: one more than the longest inner run it shares with another
    chain that goes on to another frame, at most all of it.

    Only a caller that differs tells sites apart: a chain that stops where
    another goes on, or that goes on to a frame further out in the other
    (JAX keeps some stacks cut short, and joins the stack of a nested trace,
    a scan's body, to the stack of where it was used: the forward pass's, or
    the step's line where the backward pass was made), is the same call.
    """
    groups: dict[Frame, list[tuple[Frame, ...]]] = {}
    for chain in set(chains):
        if chain:
            groups.setdefault(chain[0], []).append(chain)
    out: dict[tuple[Frame, ...], int] = {}
    for group in groups.values():
        frames = [set(c) for c in group]
        for i, chain in enumerate(group):
            depth = 1
            for j, other in enumerate(group):
                shared = _common(chain, other)
                if shared >= min(len(chain), len(other)):
                    continue  # one stops where the other goes on
                if chain[shared] in frames[j] or other[shared] in frames[i]:
                    continue  # a frame skipped, not another caller
                depth = max(depth, shared + 1)
            out[chain] = depth
    return out


def _common(a: tuple[Frame, ...], b: tuple[Frame, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def site(source: Source, depth: int, resolver: Resolver) -> CallSite:
    """The call site of `source` made of its `depth` innermost user frames."""
    frames = chain(source.frames)
    if not frames or depth <= 1:
        return CallSite(
            source.file,
            source.line,
            source.text,
            source.function,
            source.annotated,
            source.where,
            (),
            (),
        )
    outer = frames[depth - 1]
    text, where = resolver.line(outer.file, outer.line)
    helpers = frames[: depth - 1]
    # The nearest annotated function around the site, where known: not one of
    # the helpers inside it.
    annotated = source.annotated
    if annotated is not None and any(f.function == annotated for f in helpers):
        annotated = None
    return CallSite(
        os.path.basename(outer.file),
        outer.line,
        text,
        outer.function,
        annotated,
        where,
        helpers,
        tuple(resolver.line(f.file, f.line)[1] for f in helpers),
    )


def assign(
    rows: list, resolver: Resolver, stacks: Iterable[tuple[Frame, ...]] = ()
) -> list:
    """`rows` (`Collective`s) with each part's `site` set, by the rule above
    over every part of the report and every stack of the program (`stacks`,
    all frames: so that a helper is a helper by how the program calls it, not
    by which of its calls communicate)."""
    chains = [chain(resolver.user(s)) for s in stacks]
    chains += [
        chain(p.source.frames)
        for row in rows
        for p in row.parts
        if p.source is not None
    ]
    found = depths(chains)
    out = []
    for row in rows:
        parts = tuple(
            p
            if p.source is None
            else p._replace(
                site=site(p.source, found.get(chain(p.source.frames), 1), resolver)
            )
            for p in row.parts
        )
        out.append(row._replace(parts=parts))
    return out


def of(part: Any) -> Any:
    """A part's call site, or its source where none was assigned (a report
    made of rows by hand), or None (no source)."""
    found = getattr(part, "site", None)
    return found if found is not None else part.source


def key(part: Any) -> tuple[str, ...]:
    """A part's call site as a baseline keys it: `()` for no source."""
    found = of(part)
    if found is None:
        return ()
    return found.key if isinstance(found, CallSite) else (found.where,)
