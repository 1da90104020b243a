"""`no_collectives`: a block or a function that must not communicate over some
mesh axes, held at trace time where JAX can tell and in the report otherwise.

The block runs under a named scope, `jts.no_collectives[data]`, which JAX
writes into the name of every op made in it (its transpose's too), and XLA
keeps on the collectives it makes for them: the report reads the forbidden
axes of each collective's part from there (`axes`), on every JAX release and
mesh. On JAX >= 0.12 the block also runs under JAX's own
`jax.sharding.no_collectives`, which refuses, at trace time, an op that would
communicate over one of the axes when they are Explicit; its error is raised
again here with the op's line and the block's.
"""

import functools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any, Optional, TypeVar

import jax

from .._core import compat as _compat
from .._core.errors import ForbiddenCollectiveError
from .._core.site import is_library_file


_F = TypeVar("_F", bound=Callable[..., Any])
_SCOPE = "jts.no_collectives"
_MARK = re.compile(r"jts\.no_collectives\[([^\]]*)\]")


class no_collectives:
    """Says that a block or a function must not communicate over these mesh
    axes: as `with jts.no_collectives("data"):` or `@jts.no_collectives("data")`.

    On JAX >= 0.12, an op in it that would communicate over one of the axes
    when they are Explicit raises [`jaxtyping_shard.ForbiddenCollectiveError`][]
    at trace time, naming the op's line and the axis. Everywhere (older JAX,
    Auto axes, a collective XLA adds), `jts.collectives(step, ...).check()`
    fails on a collective over one of the axes made in it, naming its line.
    Nested blocks forbid the union of their axes.
    """

    def __init__(self, *axes: str):
        if not axes or not all(isinstance(a, str) and a for a in axes):
            raise TypeError(
                f"no_collectives{axes!r}: expected mesh axis names, like "
                '`jts.no_collectives("data")` or `jts.no_collectives("data", "model")`'
            )
        bad = [a for a in axes if any(c in a for c in "[],/")]
        if bad:
            raise ValueError(
                f"no_collectives: {bad[0]!r} is not a mesh axis name (no `[],/`)"
            )
        self.axes: tuple[str, ...] = tuple(dict.fromkeys(axes))
        caller = sys._getframe(1)
        self.declared = (
            f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        )
        self._open: list[ExitStack] = []

    def __repr__(self) -> str:
        return f"no_collectives({', '.join(repr(a) for a in self.axes)})"

    def __enter__(self) -> "no_collectives":
        stack = ExitStack()
        stack.enter_context(jax.named_scope(f"{_SCOPE}[{','.join(self.axes)}]"))
        state = _compat.no_collectives_state()
        if state is not None:
            stack.enter_context(state(frozenset(state.value) | frozenset(self.axes)))
        self._open.append(stack)
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> bool:
        self._open.pop().close()
        if error is not None and _compat.is_forbidden_collective(error):
            raise ForbiddenCollectiveError(self._message(error, tb)) from error
        return False

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # pyright: ignore[reportReturnType]

    def _message(self, error: BaseException, tb: Any) -> str:
        frames = [
            f
            for f in traceback.extract_tb(tb)
            if not is_library_file(f.filename) and f.filename != __file__
        ][::-1]  # innermost first
        said = str(error)
        axis = next((a for a in self.axes if f"'{a}'" in said), self.axes[0])
        if frames:
            op = frames[0]
            where = f"{os.path.basename(op.filename)}:{op.lineno} in `{op.name}`"
            if op.line:
                where += f": {op.line.strip()}"
            callers = "".join(
                f", called from {os.path.basename(f.filename)}:{f.lineno} in `{f.name}`"
                for f in frames[1:]
            )
        else:
            where, callers = "an op", ""
        return (
            f"{where}{callers}: communicates over mesh axis `{axis}`, which "
            f"`{self!r}` (at {self.declared}) forbids; JAX: {said} Fix: lay the "
            f"operands out so that the op runs on each device's shards (the axis "
            f"`{axis}` on a dim the op keeps), mark the result unreduced over "
            f"`{axis}` and reduce it outside the block, or move the op out of it."
        )


no_collectives.__module__ = "jaxtyping_shard"


def axes(op_name: str) -> frozenset[str]:
    """The axes the `no_collectives` blocks around an op forbid, from its name."""
    found: set[str] = set()
    for listed in _MARK.findall(op_name):
        found.update(a for a in listed.split(",") if a)
    return frozenset(found)


def problems(rows: Iterable[Any], describe: Callable[[Any], str]) -> list[str]:
    """A line per part of `rows` that runs over an axis forbidden where it was
    made (`describe`: a part's line in words)."""
    out = []
    for row in rows:
        for part in row.parts:
            hit = sorted(set(row.axes) & set(getattr(part, "no_collectives", ())))
            if hit:
                out.append(
                    f"no_collectives({', '.join(repr(a) for a in hit)}): "
                    f"{row.kind} over {row.over}, {part.shape}, at {describe(part)}"
                )
    return out
