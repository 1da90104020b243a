"""Sharding-aware jaxtyping annotations for JAX.

`Float[Array, "batch embed", P("data", None)]` checks shape and dtype as jaxtyping
does, and the sharding too: on concrete arrays, inside `jit` and inside `shard_map`.
"""

import importlib.metadata as _metadata
import typing as _typing

from ._annotation.jaxtyped import jaxtyped as jaxtyped
from ._annotation.used import Used as Used
from ._core.errors import (
    CollectiveBudgetError as CollectiveBudgetError,
    ForbiddenCollectiveError as ForbiddenCollectiveError,
    LayoutChangeError as LayoutChangeError,
    PlacementError as PlacementError,
    ShardingAnnotationError as ShardingAnnotationError,
    ShardingTypeCheckError as ShardingTypeCheckError,
    ShardingWarning as ShardingWarning,
)
from ._core.modes import get_mode as get_mode, set_mode as set_mode
from ._drivers.contraction import einsum as einsum
from ._drivers.init.sharded_init import (
    abstract as abstract,
    sharded_init as sharded_init,
)
from ._drivers.jit.filter import filter_jit as filter_jit
from ._drivers.jit.jit import jit as jit, sharding_errors as sharding_errors
from ._drivers.jit.nnx_jit import nnx_jit as nnx_jit
from ._drivers.place.place import (
    local_rows as local_rows,
    place as place,
    place_for as place_for,
)
from ._drivers.reshard import (
    as_used as as_used,
    out_sharding as out_sharding,
    reshard as reshard,
)
from ._drivers.shard_map import typed_shard_map as typed_shard_map
from ._drivers.shardings import shardings as shardings
from ._layout.bridge import sharding_of as sharding_of, spec_of as spec_of
from ._layout.follows import FollowsField as FollowsField
from ._layout.logical import Logical as Logical
from ._layout.spec import format_spec as format_spec
from ._report.collectives import (
    Collectives as Collectives,
    collectives as collectives,
)
from ._report.explain import explain as explain, Explanation as Explanation
from ._report.layouts import (
    Layout as Layout,
    Layouts as Layouts,
    layouts as layouts,
)
from ._report.memory import PreflightReport as PreflightReport
from ._report.no_comm import no_collectives as no_collectives
from ._report.preflight import preflight as preflight
from ._rules.scope import (
    axis_rules as axis_rules,
    flax_rules as flax_rules,
    get_axis_rules as get_axis_rules,
    set_axis_rules as set_axis_rules,
)
from ._rules.table import AxisRules as AxisRules, fsdp as fsdp
from ._trees.check_tree import check_tree as check_tree
from ._trees.leaves import TreeSummary as TreeSummary
from ._trees.like_hint import Like as Like, Unreduced as Unreduced
from ._trees.linen import logical_specs as logical_specs


if _typing.TYPE_CHECKING:
    from ._annotation.indirection import (
        BFloat16 as BFloat16,
        Bool as Bool,
        Complex as Complex,
        Complex64 as Complex64,
        Complex128 as Complex128,
        Float as Float,
        Float8e4m3b11fnuz as Float8e4m3b11fnuz,
        Float8e4m3fn as Float8e4m3fn,
        Float8e4m3fnuz as Float8e4m3fnuz,
        Float8e5m2 as Float8e5m2,
        Float8e5m2fnuz as Float8e5m2fnuz,
        Float16 as Float16,
        Float32 as Float32,
        Float64 as Float64,
        Inexact as Inexact,
        Int as Int,
        Int2 as Int2,
        Int4 as Int4,
        Int8 as Int8,
        Int16 as Int16,
        Int32 as Int32,
        Int64 as Int64,
        Integer as Integer,
        Key as Key,
        Num as Num,
        Real as Real,
        Shaped as Shaped,
        Stacked as Stacked,
        Tree as Tree,
        UInt as UInt,
        UInt2 as UInt2,
        UInt4 as UInt4,
        UInt8 as UInt8,
        UInt16 as UInt16,
        UInt32 as UInt32,
        UInt64 as UInt64,
    )
else:
    from ._annotation.dtypes import (
        BFloat16 as BFloat16,
        Bool as Bool,
        Complex as Complex,
        Complex64 as Complex64,
        Complex128 as Complex128,
        Float as Float,
        Float8e4m3b11fnuz as Float8e4m3b11fnuz,
        Float8e4m3fn as Float8e4m3fn,
        Float8e4m3fnuz as Float8e4m3fnuz,
        Float8e5m2 as Float8e5m2,
        Float8e5m2fnuz as Float8e5m2fnuz,
        Float16 as Float16,
        Float32 as Float32,
        Float64 as Float64,
        Inexact as Inexact,
        Int as Int,
        Int2 as Int2,
        Int4 as Int4,
        Int8 as Int8,
        Int16 as Int16,
        Int32 as Int32,
        Int64 as Int64,
        Integer as Integer,
        Key as Key,
        Num as Num,
        Real as Real,
        Shaped as Shaped,
        UInt as UInt,
        UInt2 as UInt2,
        UInt4 as UInt4,
        UInt8 as UInt8,
        UInt16 as UInt16,
        UInt32 as UInt32,
        UInt64 as UInt64,
    )
    from ._trees.stacked import Stacked as Stacked
    from ._trees.tree_hint import Tree as Tree

from ._annotation.typeguard import register as _register_with_typeguard


_register_with_typeguard()

try:
    __version__ = _metadata.version("jaxtyping-shard")
except _metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"

__all__ = [
    "AxisRules", "BFloat16", "Bool", "Complex", "Complex64", "Complex128",
    "CollectiveBudgetError", "Collectives", "collectives",
    "Explanation", "Float", "FollowsField", "ForbiddenCollectiveError",
    "Float8e4m3b11fnuz", "Float8e4m3fn", "Float8e4m3fnuz",
    "Float8e5m2", "Float8e5m2fnuz", "Float16", "Float32", "Float64", "Inexact",
    "Int", "Int2", "Int4", "Int8", "Int16", "Int32", "Int64", "Integer", "Key",
    "Layout", "LayoutChangeError", "Layouts", "layouts", "Like",
    "Logical", "Num", "PlacementError", "PreflightReport", "Real", "Shaped",
    "ShardingAnnotationError", "ShardingTypeCheckError", "ShardingWarning", "Stacked",
    "Tree",
    "TreeSummary", "UInt", "UInt2", "UInt4", "UInt8", "UInt16", "UInt32", "UInt64",
    "Unreduced", "Used", "abstract", "as_used",
    "axis_rules", "check_tree", "einsum", "explain", "filter_jit", "flax_rules",
    "format_spec", "fsdp",
    "get_axis_rules",
    "get_mode", "jaxtyped", "jit", "local_rows", "logical_specs", "nnx_jit",
    "no_collectives", "out_sharding", "place",
    "place_for", "preflight", "reshard", "set_axis_rules", "set_mode", "sharded_init",
    "sharding_errors", "sharding_of", "shardings", "spec_of", "typed_shard_map",
]  # fmt: skip


def __dir__() -> list[str]:
    # The public API only: not the private rooms, nor the modules imported above.
    return sorted(__all__)
