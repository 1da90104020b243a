"""Stacked layers: leaves with extra leading dims their annotation does not name.

`stacked={pattern: n}` (or `{pattern: ("pipe",)}`) declares that the leaves
whose key path matches the pattern (the path rules' syntax) have `n` extra
leading dims, replicated (or sharded as given), before the dims their
annotation describes: layers stacked with `eqx.filter_vmap` or `nnx.vmap`.
`Stacked[Block]` (`Stacked[Block, 2]`, `Stacked[Block, ("pipe",)]`) declares
the same once, where the field is declared; the walk reads it.

The walk (`walk.plan_for`) is the one place either is applied: a stacked leaf's
annotation becomes a `Lead` (`_layout.spec`), which `spec_for` resolves (every
driver's shardings) and `lead_check.LeadCheck` checks (every tree check).
"""

import typing
from collections.abc import Mapping
from typing import Any, Union

from jax.sharding import PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout import given as _given
from .._layout.spec import has_sharding, Lead
from .._layout.validate import validate_spec
from . import paths as _paths


# `stacked=` values: how many extra leading dims, or one spec entry for each.
StackedSpec = Union[int, tuple]


def _leading(value: Any, pattern: str, label: str = "") -> tuple:
    label = label or f"stacked[{pattern!r}]"
    if isinstance(value, bool) or not isinstance(value, (int, tuple)):
        raise ShardingAnnotationError(
            f"{label} must be the number of extra leading dims (`1`) or "
            f"one spec entry per extra dim (`('pipe',)`, `(None,)`), not {value!r}."
        )
    if isinstance(value, int):
        if value < 1:
            raise ShardingAnnotationError(
                f"{label} = {value}: a stack adds at least one dim."
            )
        return (None,) * value
    if not value:
        raise ShardingAnnotationError(f"{label} = (): a stack adds at least one dim.")
    validate_spec(PartitionSpec(*value), f"{label}")
    return value


class Lenient:
    """`stacked=` for a function's arguments and result (`jts.jit`): matched
    against each of them, a pattern need not match a leaf in every one."""

    def __init__(self, stacked: Mapping[str, StackedSpec]):
        self.stacked = stacked

    def key(self) -> Any:
        return ("lenient", key(self.stacked))


def lenient(stacked: Any) -> Any:
    return Lenient(stacked) if stacked else None


def key(stacked: Any) -> Any:
    """`stacked=` in a plan's cache key (hashable)."""
    if not stacked:
        return None
    if isinstance(stacked, Lenient):
        return stacked.key()
    if isinstance(stacked, Mapping):
        return tuple(stacked.items())
    return ("invalid", id(stacked))  # refused by stacked_prefixes


def stacked_prefixes(paths: tuple, stacked: Any) -> list[tuple]:
    """For each leaf, the spec entries of its declared extra leading dims."""
    out: list[tuple] = [()] * len(paths)
    strict = not isinstance(stacked, Lenient)
    stacked = stacked if strict else stacked.stacked
    if not stacked:
        return out
    if not isinstance(stacked, Mapping):
        raise ShardingAnnotationError(
            f"stacked must map a path pattern to a number of leading dims, e.g. "
            f"{{'blocks/**': 1}}, not {type(stacked).__name__}."
        )
    texts = [_paths.rule_path(p) for p in paths]
    for pattern, value in stacked.items():
        lead = _leading(value, pattern)
        regex = _paths.compile_pattern(pattern)  # the rules' pattern syntax
        hits = [i for i, text in enumerate(texts) if regex.fullmatch(text)]
        if not hits and strict:
            sample = ", ".join(repr(t) for t in texts[:6])
            raise ShardingAnnotationError(
                f"stacked: the pattern {pattern!r} matches no leaf. Paths look like "
                f"{sample or '(no leaves)'}: keys joined with '/', `*` within a key, "
                "`**` across keys."
            )
        for i in hits:
            if out[i]:
                raise ShardingAnnotationError(
                    f"stacked: the leaf `{texts[i]}` is matched by two patterns; "
                    "declare each stack once."
                )
            out[i] = lead
    return out


def with_leads(paths: tuple, annotations: tuple, hinted: list, stacked: Any) -> tuple:
    """The plan's annotations, each stacked leaf's made a `Lead`: its leading
    dims declared by a `Stacked[...]` hint above it (`hinted`) or by `stacked=`
    (never both). An unannotated leaf stays unannotated."""
    declared = stacked_prefixes(paths, stacked)
    if not any(hinted) and not any(declared):
        return annotations
    out = []
    for path, annotation, by_hint, by_key in zip(paths, annotations, hinted, declared):
        if by_hint and by_key:
            raise ShardingAnnotationError(
                f"stacked: the leaf `{_paths.rule_path(path)}` is declared stacked "
                f"twice: by a `jts.Stacked[...]` hint above it "
                f"({by_hint}) and by `stacked=` ({by_key}). Declare each stack once: "
                "drop the pattern from `stacked=`."
            )
        lead = by_hint or by_key
        out.append(
            Lead(annotation, lead) if lead and annotation is not None else annotation
        )
    return tuple(out)


class StackMark:
    """The metadata `Stacked[Block, ...]` puts in `Annotated[Block, ...]`."""

    def __init__(self, lead: tuple):
        self.lead = lead

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StackMark) and other.lead == self.lead

    def __hash__(self) -> int:
        return hash((StackMark, self.lead))

    def __repr__(self) -> str:
        return f"jaxtyping_shard.Stacked{self.lead!r}"


class Stacked:
    """`Stacked[Block]`: a `Block` whose every leaf has one extra leading dim
    (layers stacked with `eqx.filter_vmap`), replicated; `Stacked[Block, 2]` two;
    `Stacked[Block, ("pipe",)]` one, sharded over the mesh axis `"pipe"` (the
    values `stacked=` takes). It is `typing.Annotated[Block, ...]`: runtime type
    checkers (beartype, typeguard) check `isinstance(x, Block)`."""

    def __init__(self) -> None:
        raise TypeError("Stacked is written as a type hint: `Stacked[Block]`.")

    def __class_getitem__(cls, item: Any) -> Any:
        if isinstance(item, tuple) and len(item) != 2:
            raise ShardingAnnotationError(
                f"Stacked[...] takes a layer's type and how many dims (or one spec "
                f"entry per dim): `Stacked[Block]`, `Stacked[Block, 2]`, "
                f"`Stacked[Block, ('pipe',)]`; not {item!r}."
            )
        hint, value = item if isinstance(item, tuple) else (item, 1)
        if not (isinstance(hint, type) or typing.get_origin(hint) is not None):
            raise ShardingAnnotationError(
                f"Stacked[{hint!r}]: the first argument is the type of one layer "
                "(`Stacked[Block]`), not a value."
            )
        shown = getattr(hint, "__qualname__", None) or repr(hint)
        lead = _leading(value, "", f"Stacked[{shown}, ...]")
        return typing.Annotated[hint, StackMark(lead)]


def mark_of(hint: Any) -> tuple[Any, tuple]:
    """`(hint, lead)`: a `Stacked[T, ...]` hint's `T` and its leading entries;
    any other hint unchanged, with `()`."""
    if typing.get_origin(hint) is not typing.Annotated:
        return hint, ()
    args = typing.get_args(hint)
    marks = [m for m in hint.__metadata__ if isinstance(m, StackMark)]
    if not marks:
        return hint, ()
    rest = tuple(m for m in hint.__metadata__ if not isinstance(m, StackMark))
    inner = typing.Annotated[(args[0], *rest)] if rest else args[0]
    return inner, tuple(e for m in marks for e in m.lead)


def rank_mismatch(leaf: Any, annotation: Any, lead: tuple) -> str:
    """Why a stacked leaf's rank cannot hold its declared leading dims and then
    its annotation's ("" if it can): a mismatch of that leaf, reported with the
    others (a layer not stacked, or stacked twice), not an annotation error."""
    rank = len(getattr(leaf, "shape", ()))
    if rank < len(lead):
        return f"rank {rank}: fewer dims than its {len(lead)} declared stacked"
    if not has_sharding(annotation):
        return ""
    fixed = _given.fixed_rank(annotation)
    least = _given.layout_of(annotation).min_rank
    rest = rank - len(lead)
    if (fixed is None or rest == fixed) and rest >= least:
        return ""
    dims = f"{fixed}" if fixed is not None else f"at least {least}"
    stacked = f"{len(lead)} declared stacked dim{'s' if len(lead) > 1 else ''}"
    return (
        f"rank {rank}: its {stacked} and the {dims} dims of "
        f"{_given.describe(annotation)} make rank "
        f"{len(lead) + fixed if fixed is not None else f'{len(lead) + least} or more'}"
    )
