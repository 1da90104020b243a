"""Each leaf of a tree against its checker, how much of the tree a check saw, and
the one error that lists what failed.

`leaf_failures` checks the leaves (arrays, tracers, `jax.ShapeDtypeStruct`s),
each on its own. Every tree check counts the leaves it checked and the array
leaves that declare no sharding (unannotated: nothing, an annotation without a
sharding, or a hint above them that cannot be read or declares nothing).
`check_tree(..., summary=True)` returns the count as a `TreeSummary`; its error,
and the `jaxtyping_shard.jit` boundary's, say it in their first line;
`strict=True` makes each unannotated array leaf a failure, named by key path.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import jax
from jax.core import Tracer

# jaxtyping binds dim names in the memo of the innermost `jaxtyped` call. A tree's
# leaves are checked each on its own (a `list[Block]` may hold blocks of different
# widths), so the memo stack is hidden while they are: read in this one place.
from jaxtyping._storage import _shape_storage

from .._annotation.hot_path import kept
from .._core import site as _site
from .._core.compat import ARRAY_IMPL
from .._core.errors import ShardingAnnotationError, ShardingTypeCheckError
from .._core.failures import warn_at_user_line
from .._core.modes import current_mode
from .._layout import given as _given, spec as _spec
from .._layout.spec import has_sharding, sharded_members
from .._verdict import constraints as _constraints
from .._verdict.compare import FIX
from . import paths as _paths


def leaf_failures(
    leaves: list,
    paths: tuple,
    checkers: tuple,
    name: str,
    function: Optional[str] = None,
    is_return: bool = False,
    name_sites: bool = True,
    placed: Optional[tuple] = None,
) -> list:
    """`[(path name, reason), ...]` for the leaves that fail their checkers.

    `name_sites=False` leaves compile-time checks to find their own site (under
    `jaxtyped`, the parameter and the key path inside it). `placed`: per leaf,
    the sharding `jit`'s `in_shardings` or `out_shardings` give that traced leaf
    (or `None`), so that its check is decided at trace time (see
    `_verdict.constraints`).
    """
    failures = []
    hidden = getattr(_shape_storage, "memo_stack", None)
    if hidden:
        _shape_storage.memo_stack = []
    path: tuple = ()
    try:
        for i, (leaf, checker, path) in enumerate(zip(leaves, checkers, paths)):
            if checker is None:
                continue
            stacked = isinstance(checker, RankFirst)
            reason_of = _named(_paths.path_name(name, path)) if stacked else _reason
            if stacked:  # stacked: its rank first
                wrong = checker._jts_rank_reason(leaf)
                found: Any = Missing(wrong, layout=True) if wrong else checker
                checker = found
            if leaf.__class__ is ARRAY_IMPL and type(checker) is not Missing:
                # A concrete array, the common case: its check, and no more.
                if not stacked and isinstance(leaf, checker):  # type: ignore[arg-type]
                    continue
                reason = reason_of(checker, leaf)
            elif type(checker) is Missing:
                reason = checker.reason
                if checker.layout and current_mode() != "check":
                    # A layout mismatch: warned (mode "warn") or not checked.
                    if current_mode() == "warn":
                        warn_at_user_line(f"{_paths.path_name(name, path)}: {reason}")
                    continue
            elif isinstance(leaf, Tracer) and not stacked and kept(checker, leaf):
                # A type it passed on an Explicit mesh: jaxtyping's check alone,
                # nothing to schedule, so no site to name.
                reason = checker.__instancecheck_str__(leaf)  # type: ignore[union-attr]
            elif isinstance(leaf, Tracer) and not name_sites:
                reason = reason_of(checker, leaf)
            elif isinstance(leaf, Tracer):
                # Compile-time (Auto) checks name the leaf by its key path.
                argument = None if is_return else name
                keys = jax.tree_util.keystr(path)
                sharding = placed[i] if placed is not None else None
                with _site.naming(function, argument, is_return, keys):
                    with _constraints.placed(leaf, sharding):
                        reason = reason_of(checker, leaf)
            elif isinstance(leaf, jax.ShapeDtypeStruct):
                reason = reason_of(checker, leaf, _abstract_reason)
            elif not stacked and isinstance(leaf, checker):  # type: ignore[arg-type]
                continue
            else:
                reason = reason_of(checker, leaf)
            if reason:
                hint = _stack_hint(leaf, checker)
                reason = f"{reason.rstrip('.')}.{hint}" if hint else reason
                failures.append((_paths.path_name(name, path), reason))
    except ShardingAnnotationError as error:
        # An annotation that cannot resolve here (no rules, a name with no
        # rule): the leaf first, as the annotation alone does not say which.
        where = _paths.path_name(name, path)
        if type(error) is not ShardingAnnotationError or str(error).startswith(where):
            raise
        raise ShardingAnnotationError(f"{where}: {error}") from None
    finally:
        if hidden:
            _shape_storage.memo_stack = hidden
    return failures


def _named(leaf_name: str) -> Any:
    """`_reason` for a stacked leaf: an annotation error its check raises (its
    stack and its layer on one mesh axis, a logical name with no rule) names
    the leaf first, as its annotation alone does not say which leaf it is."""

    def reason(checker: Any, leaf: Any, one: Any = None) -> str:
        try:
            return _reason(checker, leaf, one)
        except ShardingAnnotationError as error:
            raise ShardingAnnotationError(f"{leaf_name}: {error}") from None

    return reason


def _stack_hint(leaf: Any, checker: Any) -> str:
    """A leaf with more dims than its annotation fixes may be a stack of layers:
    what a rank mismatch adds, saying how to declare one."""
    if not all(hasattr(m, "index_variadic") for m in sharded_members(checker)):
        return ""  # a spec, a sharding: any rank
    fixed = _given.fixed_rank(checker)
    rank = len(getattr(leaf, "shape", ()))
    return _given.stack_hint(rank - fixed) if fixed is not None and rank > fixed else ""


def _reason(checker: Any, leaf: Any, one: Any = None) -> str:
    """Why `leaf` fails `checker` ("" if it passes): `one(annotation, leaf)`,
    by default the annotation's own `__instancecheck_str__`; a union passes if
    one of its members does."""
    check = one or (lambda annotation, value: annotation.__instancecheck_str__(value))
    members = sharded_members(checker) if not hasattr(checker, "_jts") else ()
    if members:
        with _site.checking_hint(checker):  # a verdict left to XLA knows them all
            reasons = [check(m, leaf) for m in members]
        return "" if "" in reasons else reasons[0]
    return check(checker, leaf)


def _abstract_reason(checker: Any, leaf: jax.ShapeDtypeStruct) -> str:
    """A `jax.ShapeDtypeStruct` (what `abstract` and `jax.eval_shape` give, what a
    checkpoint is restored into) against one annotation (see `_reason` for
    unions): its dtype and shape as jaxtyping checks an array's, then its
    `sharding` as a concrete array's."""
    dtype, dims = getattr(checker, "dtype", None), getattr(checker, "dim_str", None)
    if dtype is None or dims is None:  # not an array annotation
        return _reason(checker, leaf)
    twin = _abstract_twins.get(checker)
    if twin is None:
        twin = _abstract_twins[checker] = dtype[jax.ShapeDtypeStruct, dims]
    message = type(twin).__instancecheck_str__(twin, leaf)
    if message or not has_sharding(checker):
        return message
    if leaf.sharding is None:
        hint = getattr(getattr(checker, "_jts", None), "text", None) or checker.__name__
        shown = _spec.format_array(leaf.dtype, leaf.shape, ())
        return (
            f"this `jax.ShapeDtypeStruct` ({shown}) has no sharding, and its type "
            f"hint {hint} asks for one. Give it `sharding=` (`jts.abstract` does), "
            "or check the arrays themselves."
        )
    return checker._jts_sharding_str(leaf)  # the sharding part of the check


# Per annotation, jaxtyping's dtype-and-dims check of a `jax.ShapeDtypeStruct`.
_abstract_twins: dict = {}


@dataclasses.dataclass(frozen=True)
class TreeSummary:
    """How much of a tree [`jaxtyping_shard.check_tree`][] checked.

    Returned by `check_tree(..., summary=True)` (and held by its error as
    `error.summary`); `str()` of it is one line.

    !!! Example

        ```python
        import jax.numpy as jnp
        import jaxtyping_shard as jts

        tree = {"w": jnp.ones((8, 4))}  # nothing declared: expected here
        summary = jts.check_tree(tree, summary=True, may_check_nothing=True)
        assert summary.checked == 0 and summary.unannotated == ("tree['w']",)
        ```

    **Attributes:**

    - `tree`: the tree checked, as given.
    - `leaves`: how many leaves it has.
    - `checked`: how many of them were checked against an annotation (with
        `like=`: against the leaf of `like`).
    - `unannotated`: the array leaves that declare no sharding, by key path:
        no annotation, one without a sharding (`Float[Array, "e"]`), or under a
        hint that cannot be read or declares nothing (`Any`, a third-party
        class's fields). `strict=True` makes each a failure.
    - `notes`: for those of them under a hint that cannot be read, why.
    """

    tree: Any
    leaves: int
    checked: int
    unannotated: tuple
    notes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        text = f"{self.checked} of {self.leaves} leaves checked"
        if self.unannotated:
            shown = ", ".join(self.unannotated[:8])
            more = f", ... ({len(self.unannotated)} in all)" * (
                len(self.unannotated) > 8
            )
            text += f"; array leaves declaring no sharding: {shown}{more}"
        return text


TreeSummary.__module__ = "jaxtyping_shard"


class Counts:
    """The leaves checked, and the unannotated array leaves, of one or more trees
    (a function's arguments)."""

    def __init__(self) -> None:
        self.leaves = 0
        self.checked = 0
        self.unannotated: list = []  # (name, key path, note)

    def add(self, name: str, leaves: list, plan: Any, checkers: tuple) -> int:
        """Counts one tree; returns how many of its leaves are checked."""
        checked, bare = _bare(plan, checkers)
        for i in bare:  # those of them that are arrays are unannotated
            if is_array(leaves[i]):
                note = plan.notes[i] if plan.notes else None
                self.unannotated.append((name, plan.paths[i], note))
        self.leaves += len(leaves)
        self.checked += checked
        return checked

    def names(self) -> tuple:
        return tuple(_paths.path_name(n, p) for n, p, _ in self.unannotated)

    def summary(self, tree: Any) -> TreeSummary:
        notes = {
            _paths.path_name(n, p): note for n, p, note in self.unannotated if note
        }
        return TreeSummary(tree, self.leaves, self.checked, self.names(), notes)

    def strict_failures(self) -> list:
        """`[(path name, reason), ...]`: each unannotated array leaf, as a failure."""
        return [
            (
                _paths.path_name(n, p),
                "declares no sharding (strict=True)" + (f": {note}" if note else ""),
            )
            for n, p, note in self.unannotated
        ]


class RankFirst:
    """A checker whose `_jts_rank_reason(leaf)` `leaf_failures` asks first (a
    stacked leaf's: a rank that cannot hold the stack is a layout mismatch)."""

    def _jts_rank_reason(self, obj: Any) -> str:
        raise NotImplementedError


class Missing:
    """A leaf's checker that always fails, for a reason found before checking: a
    leaf of `tree` with no counterpart in `like` (always), or a stacked leaf whose
    rank cannot hold its layout (`layout=True`: a sharding mismatch, reported as
    the mode says)."""

    def __init__(self, reason: str, layout: bool = False):
        self.reason = reason
        self.layout = layout


def _bare(plan: Any, checkers: tuple) -> tuple[int, tuple]:
    """`(how many leaves are checked, the indices of those whose checker declares
    no sharding)`, kept on the plan for the last checkers it was asked about (a
    tree checked at every step costs no per-leaf work here)."""
    hit = plan.cache.get("bare")
    if hit is not None and hit[0] is checkers:
        return hit[1]
    out = (
        sum(c is not None for c in checkers),
        tuple(
            i
            for i, c in enumerate(checkers)
            if not (has_sharding(c) or type(c) is Missing or _is_stacked(c))
        ),
    )
    plan.cache["bare"] = (checkers, out)
    return out


def _is_stacked(checker: Any) -> bool:
    return getattr(checker, "_jts_stacked", False) is True


def is_array(x: Any) -> bool:
    """An array, a tracer, a `jax.ShapeDtypeStruct` or a NumPy array."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _leaves(n: int) -> str:
    return f"{n} array leaf" if n == 1 else f"{n} array leaves"


def error(
    what: str,
    failures: list,
    counts: Counts,
    structure: Optional[list] = None,
    strict: bool = False,
) -> ShardingTypeCheckError:
    """One error for all: the leaves that fail their annotation (`failures`), the
    nodes their hints do not fit (`structure`), and under `strict` the
    unannotated array leaves; the fix said once."""
    structure = structure or []
    bare = counts.strict_failures() if strict else []
    pieces = []
    if failures:
        pieces.append(
            f"{len(failures)} of {counts.checked} checked leaves do not match their "
            f"annotation{'s' if len(failures) > 1 else ''}"
        )
    if structure:
        pieces.append(
            f"{len(structure)} part{'s' if len(structure) > 1 else ''} of the tree "
            f"do{'' if len(structure) > 1 else 'es'} not fit the type hints"
        )
    if bare:
        verb = "declares" if len(bare) == 1 else "declare"
        pieces.append(f"{_leaves(len(bare))} {verb} no sharding (strict=True)")
    head = f"{what}: {'; '.join(pieces)}"
    said = [] if failures else [f"{counts.checked} leaves checked"]
    if counts.unannotated and not strict:
        said.append(f"{_leaves(len(counts.unannotated))} unannotated")
    if said:
        head += f" ({', '.join(said)})"
    lines = []
    fix = ""
    for path, reason in [*structure, *failures, *bare]:
        if reason.endswith(FIX):
            reason = reason[: -len(FIX)].rstrip()
            fix = FIX
        lines.append(f"  {path}: {reason}")
    return ShardingTypeCheckError(
        "\n".join([f"{head}:", *lines, *([fix] if fix else [])])
    )
