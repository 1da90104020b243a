"""`AxisRules`: a logical axis rules table, parsed and validated.

Maps logical names (`batch`, `embed`, `mlp`) to candidates, each a tuple of mesh
axes (`()`: replicated). Which table is in force is `scope`'s business; turning one
array's logical names into spec entries is `_layout.resolve`'s.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

from .._core.errors import ShardingAnnotationError


Conflicts = Literal["error", "first", "fallback"]
CONFLICTS: tuple[str, ...] = ("error", "first", "fallback")
# One way to shard a dim: the mesh axes it is split over (`()`: replicated).
Candidate = tuple[str, ...]

_VALUE_FORMS = (
    "A rule maps a logical name to a mesh axis (`'fsdp'`), a tuple of mesh axes "
    "split in that order (`('data', 'fsdp')`), `None` (replicated on purpose), or, "
    "in a dict, an ordered list of those as fallbacks (`['fsdp', 'tensor', None]`)."
)


def _candidate(value: Any, what: str) -> Candidate:
    if value is None:
        return ()
    if isinstance(value, str):
        names: tuple = (value,)
    elif isinstance(value, (tuple, list)):
        names = tuple(value)
    else:
        raise ShardingAnnotationError(
            f"{what} is {value!r}, which is not a mesh axis. {_VALUE_FORMS}"
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise ShardingAnnotationError(
                f"{what} holds {name!r}, which is not a mesh axis name (a non-empty "
                f"string). {_VALUE_FORMS}"
            )
    if len(set(names)) != len(names):
        raise ShardingAnnotationError(
            f"{what} names a mesh axis twice ({value!r}); a mesh axis can split a "
            "dim only once."
        )
    return names


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ShardingAnnotationError(
            f"{where}: the logical name {name!r} is not a non-empty string. Logical "
            "names are dim names such as 'batch', 'embed', 'mlp'."
        )
    return name


class AxisRules:
    """A logical axis rules table, parsed and validated; hashable and immutable.

    Built from a dict (`{"embed": "fsdp", "mlp": "tensor", "batch": None}`) or from
    a Flax Linen-style list of `(name, mesh_axes)` pairs. The two read differently:

    - a **dict** is looked up dim by dim, left to right; a list value is an ordered
      list of candidates (the first whose mesh axes are still free in this array
      and divide the dim wins);
    - a **list of pairs** is read as Flax Linen reads it: the pairs in order of
      priority, a name repeated for fallbacks, and a list or tuple value naming
      several mesh axes (as MaxText's YAML writes them).

    `conflicts` says what happens when a dim finds no free candidate: `"error"`
    (the default), `"first"` (the dim that came first keeps the mesh axis, the
    later one is replicated) or `"fallback"` (every rule ends with an implicit
    `None`, and a candidate that does not divide the dim is skipped).

    !!! Example

        ```python
        import jaxtyping_shard as jts

        fsdp = jts.AxisRules({"batch": "data", "embed": "fsdp", "mlp": None})
        linen = jts.AxisRules([("batch", "data"), ("embed", "fsdp")])
        ```
    """

    __slots__ = ("pairs", "linen", "conflicts", "_table", "_hash")

    pairs: tuple[tuple[str, Candidate], ...]
    linen: bool
    conflicts: str

    def __init__(
        self,
        rules: Union["AxisRules", Mapping[str, Any], Sequence[tuple[str, Any]]],
        *,
        conflicts: Optional[Conflicts] = None,
    ):
        if isinstance(rules, AxisRules):
            pairs, linen = rules.pairs, rules.linen
            conflicts = conflicts or rules.conflicts  # type: ignore[assignment]
        elif isinstance(rules, Mapping):
            pairs, linen = self._from_mapping(rules), False
        elif isinstance(rules, (list, tuple)):
            pairs, linen = self._from_pairs(rules), True
        else:
            raise ShardingAnnotationError(
                f"axis rules must be a dict {{name: mesh_axes}} or a list of "
                f"(name, mesh_axes) pairs (Flax Linen's form), not "
                f"{type(rules).__name__} {rules!r}."
            )
        conflicts = conflicts or "error"
        if conflicts not in CONFLICTS:
            raise ShardingAnnotationError(
                f"conflicts={conflicts!r} is not a conflict policy; use one of "
                f"{', '.join(repr(c) for c in CONFLICTS)}."
            )
        table: dict[str, list[Candidate]] = {}
        for name, candidate in pairs:
            table.setdefault(name, []).append(candidate)
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "linen", linen)
        object.__setattr__(self, "conflicts", conflicts)
        object.__setattr__(self, "_table", {k: tuple(v) for k, v in table.items()})
        object.__setattr__(self, "_hash", hash((pairs, linen, conflicts)))

    @staticmethod
    def _from_mapping(rules: Mapping[str, Any]) -> tuple[tuple[str, Candidate], ...]:
        pairs = []
        for name, value in rules.items():
            _check_name(name, "axis rules")
            if isinstance(value, list):
                if not value:
                    raise ShardingAnnotationError(
                        f"axis rule {name!r}: an empty fallback list; give at least "
                        "one candidate, e.g. ['fsdp', None]."
                    )
                for i, option in enumerate(value):
                    if isinstance(option, list):
                        raise ShardingAnnotationError(
                            f"axis rule {name!r}: candidate {i} is a list; write "
                            "several mesh axes for one dim as a tuple, e.g. "
                            "('data', 'fsdp')."
                        )
                    what = f"axis rule {name!r}, candidate {i},"
                    pairs.append((name, _candidate(option, what)))
            else:
                pairs.append((name, _candidate(value, f"axis rule {name!r}")))
        return tuple(pairs)

    @staticmethod
    def _from_pairs(rules: Sequence[Any]) -> tuple[tuple[str, Candidate], ...]:
        pairs = []
        for i, pair in enumerate(rules):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ShardingAnnotationError(
                    f"axis rules, entry {i}: {pair!r} is not a (name, mesh_axes) "
                    "pair. A Flax Linen-style rule list holds pairs such as "
                    "('embed', 'fsdp') or ('batch', ('data', 'fsdp'))."
                )
            name, value = pair
            _check_name(name, f"axis rules, entry {i}")
            pairs.append((name, _candidate(value, f"axis rule {i} ({name!r})")))
        return tuple(pairs)

    def candidates(self, name: str) -> Optional[tuple[Candidate, ...]]:
        """The candidates for `name`, in order; `None` when there is no rule."""
        return self._table.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._table)

    def with_mesh_axes(self, axes: "Sequence[str]") -> "AxisRules":
        """These rules and, last, `axis -> axis` for each of `axes` without a rule
        of its own: how Flax NNX reads a name no rule maps (as a mesh axis)."""
        extra = tuple((a, (a,)) for a in axes if a not in self._table)
        if not extra:
            return self
        out = AxisRules(self, conflicts=self.conflicts)  # type: ignore[arg-type]
        pairs = self.pairs + extra
        table: dict[str, list[Candidate]] = {}
        for name, candidate in pairs:
            table.setdefault(name, []).append(candidate)
        object.__setattr__(out, "pairs", pairs)
        object.__setattr__(out, "_table", {k: tuple(v) for k, v in table.items()})
        object.__setattr__(out, "_hash", hash((pairs, self.linen, self.conflicts)))
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("AxisRules is immutable; make a new one")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AxisRules):
            return NotImplemented
        return (self.pairs, self.linen, self.conflicts) == (
            other.pairs,
            other.linen,
            other.conflicts,
        )

    def __hash__(self) -> int:
        return self._hash

    def describe(self, only: Optional[Sequence[str]] = None) -> str:
        """`{'embed': 'fsdp', 'mlp': None}`: the rules (or those for `only`)."""
        if self.linen:
            body = ", ".join(
                f"({n!r}, {format_candidate(c)})"
                for n, c in self.pairs
                if only is None or n in only
            )
            text = f"[{body}]"
        else:
            items = []
            for name, options in self._table.items():
                if only is not None and name not in only:
                    continue
                if len(options) == 1:
                    items.append(f"{name!r}: {format_candidate(options[0])}")
                else:
                    inner = ", ".join(format_candidate(c) for c in options)
                    items.append(f"{name!r}: [{inner}]")
            text = "{" + ", ".join(items) + "}"
        if self.conflicts != "error":
            text += f" (conflicts={self.conflicts!r})"
        return text

    def __repr__(self) -> str:
        return f"AxisRules({self.describe()})"


AxisRules.__module__ = "jaxtyping_shard"


def format_candidate(candidate: Candidate) -> str:
    if not candidate:
        return "None"
    if len(candidate) == 1:
        return repr(candidate[0])
    return "(" + ", ".join(repr(a) for a in candidate) + ")"
