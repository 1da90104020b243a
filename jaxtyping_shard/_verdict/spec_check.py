"""A bare `PartitionSpec`, or a concrete sharding, as something to check against.

What the tree checks use where a leaf's annotation is a `PartitionSpec` or a
`NamedSharding` rather than an annotation class (and `like=` for the leaves of
the tree it is given): `spec_check(spec)` checks the spec on the value's own
mesh; `sharding_check(target)` compares with a concrete sharding, devices and
memory kind included (`is_equivalent_to`).
"""

import functools as ft
from typing import Any, Optional

import jax
import jaxtyping
from jax.sharding import PartitionSpec

from .._core import mesh as _mesh
from .._core.modes import mode_reader
from .._layout import spec as _spec
from .._layout.validate import validate_spec
from .check import check


# jaxtyping's own check of "any array, any shape": what a bare spec asks of a
# value before its sharding.
_ANY_ARRAY: Any = jaxtyping.Shaped[jaxtyping.Array, "..."]
_any_array_str = type(_ANY_ARRAY).__instancecheck_str__


class SpecCheck:
    """A bare `PartitionSpec` as something to check values against, as an
    annotation is (`isinstance`, `__instancecheck_str__`): any jax.Array of any
    dtype and rank, sharded as the spec says. What the tree checks use for a
    `PartitionSpec` or `NamedSharding` given as a leaf's annotation; shown in
    messages as the spec (`P('data', None)`). Build one with `spec_check`.
    """

    _jts_rank_fixed = False
    _jts_logical = False
    # A concrete sharding to compare with, devices and memory kind included (see
    # `sharding_check`); None: the spec on the value's own mesh.
    _jts_target: Any = None
    # For `check_tree`'s abstract leaves (`jax.ShapeDtypeStruct`): the dtype and
    # dims a jaxtyping annotation would give, i.e. any.
    dtype = jaxtyping.Shaped
    dim_str = "..."

    def __init__(self, layout: _spec.Layout, target: Any = None):
        self._jts = layout
        self._jts_target = target
        self._jts_verdicts: dict = {}
        self._jts_last: Any = None
        self.__name__ = self.__qualname__ = layout.text

    def __instancecheck__(self, obj: Any) -> bool:
        return self.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(self, obj: Any) -> str:
        return _any_array_str(_ANY_ARRAY, obj) or self._jts_sharding_str(obj)

    def _jts_sharding_str(self, obj: Any) -> str:
        return "" if mode_reader.value == "off" else check(self, obj)

    def __repr__(self) -> str:
        return self.__name__


@ft.lru_cache(maxsize=1024)
def spec_check(spec: PartitionSpec) -> SpecCheck:
    """The `SpecCheck` of a spec (validated here), one per spec."""
    text = _spec.format_spec(spec)
    return SpecCheck(_spec.Layout(validate_spec(spec, text), (), text))


@ft.lru_cache(maxsize=1024)
def sharding_check(target: Any, spec: Optional[PartitionSpec] = None) -> SpecCheck:
    """The `SpecCheck` of a concrete sharding: a value passes when its sharding
    is equivalent to `target` (`is_equivalent_to`: the same shards on the same
    devices, in the same memory). What a `NamedSharding` annotation means, and a
    concrete `like=` leaf's sharding. `spec`: the layout to show, and to check
    traced values with, which know no devices (default: the target's)."""
    layout: PartitionSpec = target.spec if spec is None else spec
    shown = _spec.format_spec(layout)
    mesh = getattr(target, "mesh", None)
    text = (
        f"NamedSharding(mesh {_mesh.format_mesh(mesh)}, {shown})"
        if isinstance(mesh, jax.sharding.Mesh)
        else shown
    )
    return SpecCheck(_spec.Layout(validate_spec(layout, text), (), text), target)
