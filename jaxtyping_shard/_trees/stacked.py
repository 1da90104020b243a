"""Stacked layers: leaves with extra leading dims their annotation does not name.

`stacked={pattern: n}` (or `{pattern: ("pipe",)}`) declares that the leaves
whose key path matches the pattern (the path rules' syntax) have `n` extra
leading dims, replicated (or sharded as given), before the dims their
annotation describes: layers stacked with `eqx.filter_vmap` or `nnx.vmap`.
"""

from collections.abc import Mapping
from typing import Any, Optional, Union

from jax.sharding import PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout import given as _given
from .._layout.spec import has_sharding
from .._layout.validate import validate_spec
from . import paths as _paths


# `stacked=` values: how many extra leading dims, or one spec entry for each.
StackedSpec = Union[int, tuple]


def _leading(value: Any, pattern: str) -> tuple:
    if isinstance(value, bool) or not isinstance(value, (int, tuple)):
        raise ShardingAnnotationError(
            f"stacked[{pattern!r}] must be the number of extra leading dims (`1`) or "
            f"one spec entry per extra dim (`('pipe',)`, `(None,)`), not {value!r}."
        )
    if isinstance(value, int):
        if value < 1:
            raise ShardingAnnotationError(
                f"stacked[{pattern!r}] = {value}: a stack adds at least one dim."
            )
        return (None,) * value
    if not value:
        raise ShardingAnnotationError(
            f"stacked[{pattern!r}] = (): a stack adds at least one dim."
        )
    validate_spec(PartitionSpec(*value), f"stacked[{pattern!r}]")
    return value


def stacked_prefixes(
    paths: tuple, stacked: Optional[Mapping[str, StackedSpec]]
) -> list[tuple]:
    """For each leaf, the spec entries of its declared extra leading dims."""
    out: list[tuple] = [()] * len(paths)
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
        if not hits:
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
