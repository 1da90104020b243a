"""The module tree of a collectives report: each part's module path and pass
(forward or backward), and the roll-up of counts and bytes along the paths.

**The module path** of a part is read from the chain of the user's frames
its operand was made under (`Source.frames`, each frame once), from the step
inward: the frames out to the step's own (the outermost frame named as the
step; without one, the frames every part shares) are dropped, and each frame
further in is one segment:

- a module's call (`Cls.__call__`): the attribute it was called through, read
  from the caller's line: `self.attn(x)` -> `attn`; a stacked or scanned
  layer `blocks[*]`: `self.blocks[i](x)`, a `lax.scan` / `vmap` / `nnx.scan` /
  `fori_loop` over `self.blocks` on that line (its body a lambda there, or a
  named function, under `jax.checkpoint` or not, which is then no segment of
  its own), or a `for block in self.blocks:` loop around a `block(x)`; a
  Linen module named at its call (`Decoder(c, name=f"layers_{i}")(x)`:
  `layers_*`); else its class name;
- another method called as `self.attn.forward(x)`: `attn.forward`;
- any other function: its name (the last part of its qualified name);
  lambdas are transparent.

Pure functions are so nested by their call chain (`loss_fn.cross_entropy`),
modules by their attributes (`Transformer.blocks[*].attn.project`). JAX 0.8
keeps one frame per op and no functions: every path is `()`, the root.

**The pass** of a part is read from its op's name in the compiled program
(JAX writes its transformations there): `backward` under a `transpose(...)`
(the transpose of a `jvp`, JAX's backward pass), `forward` under a `jvp(...)`
only, and for an op under neither, `other` in a program that differentiates
(the optimizer's update, a sum of gradients after their loop) and `forward`
in one that does not.

**The roll-up** sums the parts' bytes into the node of their path (and each
node above it), and counts each collective once, at the node of its largest
part (a collective XLA merged from several paths is counted where most of its
bytes come from); a conditional's collectives are counted for the branch the
report's totals count (`budget.at_most`), so the nodes add up to the flat
totals exactly.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from .call_sites import chain
from .rows import Total
from .sources import Frame, Resolver
from .text import format_bytes


PASSES = ("forward", "backward", "other")
_TRANSPOSE = re.compile(r"(^|/)transpose\(")
_JVP = re.compile(r"(^|/|\()jvp\(")
_SELF_CALL = re.compile(r"self\.(\w+)(\[[^\]]*\])?(?:\.(\w+))?\s*\(")
_SELF_ATTR = re.compile(r"self\.(\w+)\b(?!\s*\()")
_LOOP = re.compile(r"\b(scan|vmap|fori_loop|map|while_loop)\s*\(")
_BARE_CALL = re.compile(r"(?<![\w.])(\w+)\s*\(")
_NAMED = re.compile(r"\bname\s*=\s*f?[\"']([^\"']+)[\"']")


def differentiated(op_names: Iterable[str]) -> bool:
    """Whether a program differentiates: some op of it under a `jvp` or a
    `transpose`."""
    return any(_JVP.search(n) or _TRANSPOSE.search(n) for n in op_names)


def phase(op_name: str, differentiates: bool) -> str:
    """`forward`, `backward` or `other`: the pass of an op (module docstring)."""
    if _TRANSPOSE.search(op_name):
        return "backward"
    if _JVP.search(op_name) or not differentiates:
        return "forward"
    return "other"


def paths(rows: list, root: str, resolver: Resolver) -> list:
    """`rows` with each part's `path` set (the module docstring's rule)."""
    chains = {
        id(p): tuple(reversed(chain(p.source.frames)))
        for row in rows
        for p in row.parts
        if p.source is not None
    }
    shared = _shared(list(chains.values()))
    step = root.rpartition(".")[2]
    out = []
    for row in rows:
        parts = []
        for p in row.parts:
            frames = chains.get(id(p), ())
            starts = [i for i, f in enumerate(frames) if _name(f) == step]
            inner = frames[starts[0] + 1 :] if starts else frames[shared:]
            parts.append(p._replace(path=_segments(inner, resolver)))
        out.append(row._replace(parts=tuple(parts)))
    return out


def _shared(chains: list) -> int:
    """How many outer frames every chain shares (none for one chain: its
    outermost frame is kept as its own)."""
    if len(chains) < 2:
        return 0
    n = 0
    for frames in zip(*chains):
        if any(f != frames[0] for f in frames):
            break
        n += 1
    return min(n, min(len(c) for c in chains) - 1)


def _name(frame: Frame) -> str:
    return frame.function.rpartition(".")[2]


def _segments(frames: tuple, resolver: Resolver) -> tuple[str, ...]:
    out = []
    for i, frame in enumerate(frames):
        caller = frames[i - 1] if i else None
        # A named function that is the body of a loop over `self.attr` on its
        # caller's line (`lax.scan(layer, x, self.blocks)`, or a body wrapped
        # by `jax.checkpoint` first) is transparent, as a lambda there is; a
        # module called in it is the loop's `attr[*]`.
        looped = _loop_attr(caller, resolver) if _plain(frame) else ""
        if looped:
            continue
        body = i >= 2 and _plain(frames[i - 1])
        seg = _segment(
            frame, caller, resolver, _loop_attr(frames[i - 2], resolver) if body else ""
        )
        if seg:
            out.append(seg)
    return tuple(out)


def _plain(frame: Frame) -> bool:
    """A function that is no method: module-level or nested (`<locals>`)."""
    owner = frame.function.rsplit(".", 2)[-2] if frame.function.count(".") else ""
    return not owner or owner == "<locals>"


def _loop_attr(caller: Optional[Frame], resolver: Resolver) -> str:
    """The `self.attr` a `scan` / `vmap` / `fori_loop` on the caller's line
    loops over (the last one the line names: `scan(_layer(self.remat), x,
    self.blocks)` loops over `blocks`); `""` for none."""
    if caller is None:
        return ""
    text = resolver.line(caller.file, caller.line)[0]
    attrs = _SELF_ATTR.findall(text) if _LOOP.search(text) else []
    return attrs[-1] if attrs else ""


def _segment(
    frame: Frame, caller: Optional[Frame], resolver: Resolver, in_loop: str = ""
) -> str:
    qualified = frame.function
    name = qualified.rpartition(".")[2]
    if not name or name == "<lambda>" or name.startswith("<"):
        return ""
    owner = qualified.rsplit(".", 2)[-2] if qualified.count(".") else ""
    if not owner or owner == "<locals>" or caller is None:
        return name
    text = resolver.line(caller.file, caller.line)[0]
    calls = list(_SELF_CALL.finditer(text))
    wanted = None if name == "__call__" else name
    for call in calls:
        if call.group(3) == wanted or (wanted is None and call.group(3) is None):
            if wanted is not None:
                return f"{call.group(1)}.{name}"
            return call.group(1) + ("[*]" if call.group(2) else "")
    if name != "__call__":
        return name
    looped = in_loop or _loop_attr(caller, resolver)
    looped = looped or _for_loop(text, caller, resolver)
    if looped:
        return f"{looped}[*]"
    named = _NAMED.search(_arguments(text, owner))
    if named:
        return re.sub(r"\{[^}]*\}", "*", named.group(1))
    return owner


def _arguments(text: str, owner: str) -> str:
    """The arguments of the first `Owner(...)` of a line, outside any call
    nested in them (Linen's `Decoder(c, name="layers_0")(x)`); `""` for none."""
    found = re.search(rf"(?<![\w.]){re.escape(owner)}\(", text)
    if found is None:
        return ""
    depth, out = 1, []
    for char in text[found.end() :]:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
        if depth == 1 and char not in "()":
            out.append(char)
    return "".join(out)


def _for_loop(text: str, caller: Frame, resolver: Resolver) -> str:
    """The attribute a `for x in self.attr:` loop above the caller's line walks,
    when the line calls `x(...)`; `""` otherwise."""
    called = set(_BARE_CALL.findall(text))
    for back in range(1, 8):
        if caller.line - back < 1:
            break
        above = resolver.line(caller.file, caller.line - back)[0]
        loop = re.match(r"for\s+(\w+)\s+in\s+self\.(\w+)\s*:", above)
        if loop and loop.group(1) in called:
            return loop.group(2)
        if above.startswith(("def ", "class ")):
            break
    return ""


@dataclass(frozen=True)
class Node:
    """A node of the roll-up: a module path (or function) and what the
    collectives made under it run per call, all passes and per pass."""

    name: str  # its segment (`attn`, `blocks[*]`); the root: the step's name
    path: str  # the segments from the root, joined by `.`; the root: `""`
    count: int  # collectives run per call (each counted at one node)
    bytes: int  # each device receives (and sends) per call
    passes: dict[str, Total] = field(default_factory=dict)  # by pass, all three
    children: tuple["Node", ...] = ()

    @property
    def forward(self) -> Total:
        return self.passes["forward"]

    @property
    def backward(self) -> Total:
        return self.passes["backward"]

    @property
    def other(self) -> Total:
        return self.passes["other"]

    def find(self, path: str) -> Optional["Node"]:
        """The node at `path` (`blocks[*].attn`, from this node), or None."""
        node: Optional[Node] = self
        for seg in _split(path) if path else ():
            node = next((c for c in node.children if c.name == seg), None)
            if node is None:
                return None
        return node

    def walk(self) -> Iterable["Node"]:
        """This node and every node below it, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "count": self.count,
            "bytes": self.bytes,
            "passes": {
                k: {"count": t.count, "bytes": t.bytes} for k, t in self.passes.items()
            },
            "children": [c.to_dict() for c in self.children],
        }

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self, depth: int = 0) -> list[str]:
        """The tree as text, one line a node, children indented."""
        said = ", ".join(
            f"{k} {t.count} ({format_bytes(t.bytes)})"
            for k, t in self.passes.items()
            if t.count or t.bytes
        )
        head = f"{'  ' * depth}{self.name or '(root)'}: {self.count} collectives, "
        out = [head + f"{format_bytes(self.bytes)}" + (f"; {said}" if said else "")]
        for child in self.children:
            out.extend(child.lines(depth + 1))
        return out


def _split(path: str) -> list[str]:
    """`blocks[*].attn` -> `["blocks[*]", "attn"]` (a dot inside brackets kept)."""
    return [s for s in re.split(r"\.(?![^\[]*\])", path) if s]


def counted(rows: Iterable[Any], value: Callable[[Any], int], depth: int = 0) -> list:
    """The rows the report's totals of `value` count: those outside any
    conditional and, of each conditional, those of the branch with the most
    (as `budget.at_most` picks it, the first of equal ones)."""
    out: list = []
    conditionals: dict[str, dict[int, list]] = {}
    for row in rows:
        if len(row.branches) <= depth:
            out.append(row)
            continue
        branch = row.branches[depth]
        conditionals.setdefault(branch.conditional, {}).setdefault(
            branch.index, []
        ).append(row)
    for branches in conditionals.values():
        picked = [counted(inner, value, depth + 1) for inner in branches.values()]
        out.extend(max(picked, key=lambda rs: sum(value(r) for r in rs)))
    return out


def rollup(rows: tuple, root: str, by: Callable[[Any], tuple[str, ...]]) -> Node:
    """The tree of `rows` keyed by `by(part)` (a tuple of segments)."""
    counts: dict[tuple[str, ...], dict[str, int]] = {}
    sizes: dict[tuple[str, ...], dict[str, int]] = {}
    for row in counted(rows, lambda r: r.executions):
        if not row.parts:
            continue
        top = max(row.parts, key=lambda p: p.bytes)  # the first of the largest
        one = counts.setdefault(by(top), {})
        one[top.phase] = one.get(top.phase, 0) + row.executions
    for row in counted(rows, lambda r: r.bytes):
        for part in row.parts:
            one = sizes.setdefault(by(part), {})
            one[part.phase] = one.get(part.phase, 0) + part.bytes
    keys = set(counts) | set(sizes)
    return _node(root, (), keys, counts, sizes)


def _node(name, path, keys, counts, sizes) -> Node:
    here = {k: Total(0, 0) for k in PASSES}
    for k in PASSES:
        here[k] = Total(counts.get(path, {}).get(k, 0), sizes.get(path, {}).get(k, 0))
    nexts = sorted(
        {k[len(path)] for k in keys if len(k) > len(path) and k[: len(path)] == path}
    )
    children = tuple(_node(s, (*path, s), keys, counts, sizes) for s in nexts)
    passes = {
        k: Total(
            here[k].count + sum(c.passes[k].count for c in children),
            here[k].bytes + sum(c.passes[k].bytes for c in children),
        )
        for k in PASSES
    }
    return Node(
        name,
        ".".join(path),
        sum(t.count for t in passes.values()),
        sum(t.bytes for t in passes.values()),
        passes,
        children,
    )
