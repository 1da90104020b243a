"""A stacked leaf's check: its declared leading dims, then its layer's layout,
and why its rank cannot hold them (see `stacked`)."""

from typing import Any

import jax

from .._layout import bridge as _bridge, given as _given
from .._layout.spec import has_sharding, Lead
from .._verdict.check import spec_check
from .._verdict.inputs import of_value


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


class LeadCheck:
    """What the tree checks check a stacked leaf against: its declared leading
    entries, then its layer's spec for the dims after them, resolved per value
    as a check resolves (`of_value`), compared as a spec (`spec_check`)."""

    def __init__(self, lead: Lead):
        self.lead = lead
        self.__name__ = self.__qualname__ = _given.describe(lead)

    def __instancecheck__(self, obj: Any) -> bool:
        return self.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(self, obj: Any) -> str:
        wrong = self.rank_reason(obj)
        if wrong:
            return wrong
        shape, mesh = of_value(obj)
        spec = _bridge.spec_for(self.lead, shape, mesh)
        check = spec_check(spec)
        if isinstance(obj, jax.ShapeDtypeStruct) and obj.sharding is not None:
            return check._jts_sharding_str(obj)
        return check.__instancecheck_str__(obj)

    def rank_reason(self, obj: Any) -> str:
        """Why `obj`'s rank cannot hold the declared stack and its layer ("" if
        it can), saying how to declare the stack it has."""
        wrong = rank_mismatch(obj, self.lead.inner, self.lead.lead)
        if wrong:
            rank = len(getattr(obj, "shape", ()))
            fixed = _given.fixed_rank(self.lead)
            extra = rank - fixed if fixed is not None and rank > fixed else 0
            hint = (
                _given.stack_hint(extra + len(self.lead.lead)).replace(
                    "declare its", "declare all its"
                )
                if extra
                else " Check the stack declared (`stacked=` or `jts.Stacked[...]`)."
            )
            return f"{wrong}.{hint}"
        return ""
