"""`AxisRules`: a logical axis rules table, parsed and validated.

Maps logical names (`batch`, `embed`, `mlp`) to candidates, each a tuple of mesh
axes (`()`: replicated). Which table is in force is `scope`'s business; turning one
array's logical names into spec entries is `_layout.resolve`'s.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Optional, Protocol, Union

from .._core.errors import ShardingAnnotationError


Conflicts = Literal["error", "first", "fallback"]
CONFLICTS: tuple[str, ...] = ("error", "first", "fallback")
# One way to shard a dim: the mesh axes it is split over (`()`: replicated).
Candidate = tuple[str, ...]

_VALUE_FORMS = (
    "A rule maps a logical name to a mesh axis (`'fsdp'`), a tuple of mesh axes "
    "split in that order (`('data', 'fsdp')`), `None` (replicated on purpose), "
    "`jts.fsdp('data')` (split where stored, gathered where used), or, in a "
    "dict, an ordered list of those as fallbacks (`['fsdp', 'tensor', None]`)."
)


class DataclassRules(Protocol):
    """A program's own rules as a dataclass instance: one field per logical name."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


# What a rules table may be given as (see `AxisRules`).
RulesLike = Union["AxisRules", Mapping[str, Any], Sequence[Any], DataclassRules]


def record_fields(rules: Any) -> Optional[dict[str, Any]]:
    """A dataclass instance's or a NamedTuple's fields, `{name: value}`, in
    order; `None` for anything else."""
    if isinstance(rules, tuple) and hasattr(rules, "_asdict"):
        return dict(rules._asdict())  # type: ignore[attr-defined]
    if dataclasses.is_dataclass(rules) and not isinstance(rules, type):
        return {f.name: getattr(rules, f.name) for f in dataclasses.fields(rules)}
    return None


class Fsdp:
    """A rule value: the dim is split over `axes` where it is stored, and whole
    where it is used (see [`jaxtyping_shard.fsdp`][])."""

    __slots__ = ("axes",)

    axes: tuple[str, ...]

    def __init__(self, axes: tuple):
        object.__setattr__(self, "axes", axes)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("fsdp(...) is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fsdp) and self.axes == other.axes

    def __hash__(self) -> int:
        return hash(("fsdp", self.axes))

    def __repr__(self) -> str:
        return f"jts.fsdp({', '.join(repr(a) for a in self.axes)})"


Fsdp.__module__ = "jaxtyping_shard"


def fsdp(*axes: str) -> Fsdp:
    """A rule value for a logical name that FSDP shards: split over `axes` where
    the array is stored, whole (gathered) where it is used.

    `{"embed": jts.fsdp("data")}` reads, where an array is stored (a parameter,
    an optimiser moment, an activation), as the fallback list
    `{"embed": ["data", None]}`: the dim takes `data` when no other dim of the
    same array holds it (a weight), else it is replicated (an activation, whose
    `batch` holds `data`). An annotation read *as used*
    ([`jaxtyping_shard.Used`][], [`jaxtyping_shard.as_used`][]) gives the name no
    mesh axes at all: the weight gathered over FSDP for its matmul, still split
    by its other rules (tensor parallelism). So one annotation per weight, and
    one logical name per dim, serve both forms.

    !!! Example

        ```python
        import jaxtyping_shard as jts

        rules = {"batch": "data", "embed": jts.fsdp("data"), "mlp": "model"}
        ```

    **Arguments:**

    - `axes`: one or more mesh axis names, split in that order.

    **Returns:** the rule value (immutable, hashable).

    **Raises:** [`jaxtyping_shard.ShardingAnnotationError`][] for no axes, an
    axis that is not a non-empty string, or an axis named twice.
    """
    if not axes:
        raise ShardingAnnotationError(
            "jts.fsdp() needs the mesh axes that shard the stored array, e.g. "
            "jts.fsdp('data') or jts.fsdp('data', 'model')."
        )
    return Fsdp(_candidate(tuple(axes), "jts.fsdp(...)"))


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

    Built from a dict (`{"embed": "fsdp", "mlp": "tensor", "batch": None}`), from a
    program's own dataclass instance or NamedTuple of logical name -> mesh axes
    (read as the dict of its fields), or from a list of `(name, mesh_axes)` pairs
    (Flax's form, Linen's `nn.logical_axis_rules` and NNX's alike). The two read
    differently:

    - a **dict** (or dataclass, or NamedTuple) is looked up dim by dim, left to
      right; a list value is an ordered list of candidates (the first whose mesh
      axes are still free in this array and divide the dim wins);
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

    __slots__ = ("pairs", "linen", "conflicts", "gathered", "_table", "_hash", "_used")

    pairs: tuple[tuple[str, Candidate], ...]
    linen: bool
    conflicts: str
    # The names whose rule is `jts.fsdp(...)`: no mesh axes where used.
    gathered: frozenset[str]

    def __init__(
        self,
        rules: RulesLike,
        *,
        conflicts: Optional[Conflicts] = None,
    ):
        gathered: list[str] = []
        if isinstance(rules, AxisRules):
            pairs, linen = rules.pairs, rules.linen
            gathered = list(rules.gathered)
            conflicts = conflicts or rules.conflicts  # type: ignore[assignment]
        elif isinstance(rules, Mapping):
            pairs, linen = self._from_mapping(rules, gathered), False
        elif (fields := record_fields(rules)) is not None:
            owner = type(rules).__name__
            pairs, linen = self._from_mapping(fields, gathered, owner), False
        elif isinstance(rules, (list, tuple)):
            pairs, linen = self._from_pairs(rules, gathered), True
        else:
            what = "a dataclass class" if dataclasses.is_dataclass(rules) else ""
            hint = f" ({what}: pass an instance of it)" if what else ""
            raise ShardingAnnotationError(
                f"axis rules must be a dict {{name: mesh_axes}} or a list of "
                f"(name, mesh_axes) pairs (Flax Linen's and NNX's form), or a "
                f"dataclass instance or NamedTuple with one field per logical "
                f"name, not {type(rules).__name__} {rules!r}{hint}."
            )
        conflicts = conflicts or "error"
        if conflicts not in CONFLICTS:
            raise ShardingAnnotationError(
                f"conflicts={conflicts!r} is not a conflict policy; use one of "
                f"{', '.join(repr(c) for c in CONFLICTS)}."
            )
        object.__setattr__(self, "linen", linen)
        object.__setattr__(self, "conflicts", conflicts)
        self._set_pairs(pairs, frozenset(gathered))

    def _set_pairs(self, pairs: tuple, gathered: frozenset) -> None:
        table: dict[str, list[Candidate]] = {}
        for name, candidate in pairs:
            table.setdefault(name, []).append(candidate)
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "gathered", gathered)
        object.__setattr__(self, "_table", {k: tuple(v) for k, v in table.items()})
        key = (pairs, self.linen, self.conflicts, tuple(sorted(gathered)))
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "_used", None)

    @staticmethod
    def _from_mapping(
        rules: Mapping[str, Any], fsdp: list, owner: Optional[str] = None
    ) -> tuple[tuple[str, Candidate], ...]:
        pairs = []
        for name, value in rules.items():
            _check_name(name, "axis rules")
            rule = f"axis rule {name!r}"
            if owner:  # a field, named as the program spells it
                rule += f" (field {owner}.{name})"
            if isinstance(value, Fsdp):
                pairs.extend(((name, value.axes), (name, ())))
                fsdp.append(name)
            elif isinstance(value, list):
                if not value:
                    raise ShardingAnnotationError(
                        f"{rule}: an empty fallback list; give at least "
                        "one candidate, e.g. ['fsdp', None]."
                    )
                for i, option in enumerate(value):
                    if isinstance(option, Fsdp):
                        raise ShardingAnnotationError(
                            f"{rule}: jts.fsdp(...) inside a fallback "
                            "list; give it as the whole rule, "
                            f"{{{name!r}: {option!r}}} (it falls back to None)."
                        )
                    if isinstance(option, list):
                        raise ShardingAnnotationError(
                            f"{rule}: candidate {i} is a list; write "
                            "several mesh axes for one dim as a tuple, e.g. "
                            "('data', 'fsdp')."
                        )
                    what = f"{rule}, candidate {i},"
                    pairs.append((name, _candidate(option, what)))
            else:
                pairs.append((name, _candidate(value, rule)))
        return tuple(pairs)

    @staticmethod
    def _from_pairs(
        rules: Sequence[Any], fsdp: list
    ) -> tuple[tuple[str, Candidate], ...]:
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
            if isinstance(value, Fsdp):
                # Its fallback comes next, before any later pair of the name.
                pairs.extend(((name, value.axes), (name, ())))
                fsdp.append(name)
                continue
            pairs.append((name, _candidate(value, f"axis rule {i} ({name!r})")))
        return tuple(pairs)

    def candidates(self, name: str) -> Optional[tuple[Candidate, ...]]:
        """The candidates for `name`, in order; `None` when there is no rule."""
        return self._table.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._table)

    def as_used(self) -> "AxisRules":
        """These rules where an array is used: each `jts.fsdp(...)` name maps to
        no mesh axes (gathered); every other rule as it is."""
        if not self.gathered:
            return self
        if self._used is None:
            out = AxisRules(self)
            pairs = tuple(
                (n, c) for n, c in self.pairs if n not in self.gathered or not c
            )
            out._set_pairs(pairs, frozenset())
            object.__setattr__(self, "_used", out)
        return self._used  # type: ignore[return-value]

    def with_mesh_axes(self, axes: "Sequence[str]") -> "AxisRules":
        """These rules and, last, `axis -> axis` for each of `axes` without a rule
        of its own: how Flax NNX reads a name no rule maps (as a mesh axis)."""
        extra = tuple((a, (a,)) for a in axes if a not in self._table)
        if not extra:
            return self
        out = AxisRules(self, conflicts=self.conflicts)  # type: ignore[arg-type]
        out._set_pairs(self.pairs + extra, self.gathered)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("AxisRules is immutable; make a new one")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AxisRules):
            return NotImplemented
        return (self.pairs, self.linen, self.conflicts, self.gathered) == (
            other.pairs,
            other.linen,
            other.conflicts,
            other.gathered,
        )

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def show(candidate: Candidate) -> str:
        """One candidate as the rules are written: `'data'`, `('x', 'y')`, `None`."""
        return format_candidate(candidate)

    def describe(self, only: Optional[Sequence[str]] = None) -> str:
        """`{'embed': 'fsdp', 'mlp': None}`: the rules (or those for `only`)."""
        if self.linen:
            shown = []
            for n, c in self.pairs:
                if only is not None and n not in only:
                    continue
                if n in self.gathered:
                    if c:
                        shown.append(f"({n!r}, {Fsdp(c)!r})")
                    continue  # the fallback that `jts.fsdp` implies
                shown.append(f"({n!r}, {format_candidate(c)})")
            text = f"[{', '.join(shown)}]"
        else:
            items = []
            for name, options in self._table.items():
                if only is not None and name not in only:
                    continue
                if name in self.gathered:
                    items.append(f"{name!r}: {Fsdp(options[0])!r}")
                elif len(options) == 1:
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
