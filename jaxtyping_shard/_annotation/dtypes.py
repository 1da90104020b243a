"""`Float`, `Int`, ... : jaxtyping's dtype classes plus an optional sharding.

`Float[Array, "b e"]` is exactly jaxtyping's annotation. `Float[Array, "b e",
P("data", None)]` is a subclass of it whose `__instancecheck_str__` first runs
jaxtyping's own shape/dtype check, then the sharding check of `_verdict.check`.
"""

import copyreg
import typing
from typing import Any, get_args, get_origin, Union

import jax
import jaxtyping
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

# jaxtyping's `PyTree[...]` runs isinstance on leaves while it only checks the tree
# structure; its array checks then pass without looking, and so must ours. The flag
# lives in a private module, read in this one place (tested by
# test_annotation.py::test_pytree_of_sharded_leaves).
from jaxtyping._storage import get_treeflatten_memo as _in_pytree_structure_check

from .._core.compat import ARRAY_IMPL
from .._core.errors import ShardingAnnotationError
from .._core.modes import mode_flags, mode_reader
from .._layout import (
    follows as _follows,
    notation as _notation,
    resolve as _resolve,
    spec as _spec,
)
from .._layout.logical import is_logical, logical_layout, register_annotation_maker
from .._layout.validate import spec_layout, validate_spec
from .._rules.scope import current as _current_rules
from .._verdict import inputs as _inputs, manual as _manual
from .._verdict.check import check
from . import hot_path as _hot_path, typeguard as _typeguard


# jaxtyping's metaclasses are not exported; take them from public objects.
_JaxtypingArrayMeta: Any = _hot_path.JaxtypingArrayMeta
_JaxtypingDtypeMeta: Any = type(jaxtyping.AbstractDtype)


class _MetaShardedArray(_JaxtypingArrayMeta):
    """Metaclass of sharded annotations: jaxtyping's check, then the sharding."""

    # `isinstance(x, A)`: one of `hot_path`'s functions, the one for the state
    # of the mode (swapped in by `_hot_path_for`, below the class).
    __instancecheck__ = _hot_path.while_off_nowhere

    def __instancecheck_str__(cls, obj: Any) -> str:
        if obj.__class__ is not ARRAY_IMPL and isinstance(obj, Tracer):
            if _hot_path.traced_key(cls, obj) in cls._jts_traced:  # passed before
                return _jaxtyping_instancecheck_str(cls._jts_base, obj)
        return _jaxtyping_instancecheck_str(cls, obj) or cls._jts_sharding_str(obj)

    def make_transparent(cls) -> None:
        """Every value passes (jaxtyped's doing, for a generator's return hint):
        the base class (jaxtyping's, shared) is swapped for a transparent
        subclass, so the hot path reads no flag of its own."""
        if not cls._skip_instancecheck:
            base = cls._jts_base
            transparent = type(base)(base.__name__, (base,), {})
            transparent._skip_instancecheck = True
            cls._jts_base = transparent
        cls._skip_instancecheck = True

    def _jts_sharding_str(cls, obj: Any) -> str:
        """The sharding part of the check, after jaxtyping's has passed."""
        if cls._skip_instancecheck or mode_reader.value == "off":
            return ""
        if isinstance(obj, Tracer):
            if _in_pytree_structure_check():
                # jaxtyping's structure pass offers every leaf to every member of
                # a `PyTree[Union[...]]`, shapes unchecked: nothing may be
                # scheduled from it (the real pass follows).
                return ""
            key = _hot_path.traced_key(cls, obj)
            if key in cls._jts_traced or _hot_path.kept_elsewhere(cls, key):
                return ""
            message = check(_physical(cls, obj) if cls._jts_logical else cls, obj)
            return message or _hot_path.keep_traced(cls, key, obj.aval)
        if cls._jts_logical:
            cls = _physical(cls, obj)
        message = check(cls, obj)
        # Read only on failure: the flag costs more than a cached verdict.
        if message and _in_pytree_structure_check():
            return ""
        return message

    def _jts_physical(cls, obj: Any) -> Any:
        """The physical annotation this logical one means for `obj` (the verdict
        asks, for the logical members of a Union)."""
        return _physical(cls, obj)

    def _check_shape(cls, obj, single_memo, variadic_memo, arg_memo) -> str:
        # Inside shard_map a value is a local shard; its dims are checked as the
        # global array they are a piece of (see `_verdict.manual`).
        # In every mode: the annotation's meaning must not change with the mode.
        if isinstance(obj, Tracer):
            view = _manual.global_view(
                _physical(cls, obj) if cls._jts_logical else cls, obj
            )
            if view is not None:
                message = _jaxtyping_check_shape(
                    cls, view, single_memo, variadic_memo, arg_memo
                )
                return _manual.explain_shape(cls, view, message)
        return _jaxtyping_check_shape(cls, obj, single_memo, variadic_memo, arg_memo)


_jaxtyping_instancecheck_str = _JaxtypingArrayMeta.__instancecheck_str__
_jaxtyping_check_shape = _JaxtypingArrayMeta._check_shape


def _hot_path_for(flags: Any) -> None:
    _MetaShardedArray.__instancecheck__ = _hot_path.for_flags(flags)


mode_flags.listen(_hot_path_for)


_NOTHING: Any = object()  # never the `.sharding` of anything
_TWIN_LIMIT = 1024


def _physical(cls: Any, obj: Any) -> Any:
    """The physical annotation a logical one means for `obj`, here and now.

    Resolved with the rules in force, `obj`'s shape and mesh (as
    `_verdict.inputs.of_value` reads them for every path); cached per rules
    table, shape and mesh, so that a new table gives a new physical annotation,
    with verdict caches of its own.
    """
    rules = _current_rules()
    tracer = isinstance(obj, Tracer)  # never read a tracer's `.sharding` (slow)
    fast = cls._jts_fast
    # The last concrete array's sharding object, the rules and the shape: a hit
    # needs no hashing (a NamedSharding carries its mesh, so it fixes the mesh).
    if not tracer and fast[0] is getattr(obj, "sharding", None) and fast[1] is rules:
        if fast[2] == obj.shape:
            return fast[3]
    shape, mesh = _inputs.of_value(obj)
    key = (rules, shape, mesh)
    twins = cls._jts_twins
    twin = twins.get(key)
    if twin is None:
        twin = physical_annotation(cls, shape, mesh, rules)
        if len(twins) >= _TWIN_LIMIT:
            twins.clear()
        twins[key] = twin
    if not tracer and type(getattr(obj, "sharding", None)) is NamedSharding:
        cls._jts_fast = (obj.sharding, rules, obj.shape, twin)
    return twin


def physical_annotation(cls: Any, shape: Any, mesh: Any, rules: Any) -> Any:
    """The physical twin of the logical annotation `cls` (shape or rank given)."""
    layout = _resolve.physical_layout(cls._jts, shape, mesh, rules, cls.__name__)
    by_text = cls._jts_twins_by_text
    twin = by_text.get(layout.text)
    if twin is None:
        entries = _resolve.resolve(cls._jts, shape, mesh, rules, cls.__name__)
        spec = _spec.make_spec(entries, layout.unreduced, layout.reduced)
        shown = _spec.format_entries(entries)
        if layout.unreduced or layout.reduced:
            shown = _spec.format_spec(spec)
        name = f"{cls.__name__[:-1]} -> {shown}]"
        twin = _wrap(cls._jts_base, layout, name, cls._jts_dim_str, spec)
        if len(by_text) >= _TWIN_LIMIT:
            by_text.clear()
        by_text[layout.text] = twin
    return twin


def _rebuild(dtype: Any, array_type: Any, dim_str: str, spec: Any) -> Any:
    if spec is None:
        return dtype[array_type, dim_str]
    return dtype[array_type, dim_str, spec]


def _reduce_sharded(cls: Any) -> Any:
    # `_jts_dim_str` is the dim string as written (inline `@` included).
    return _rebuild, (cls.dtype, cls.array_type, cls._jts_dim_str, cls._jts_spec_arg)


copyreg.pickle(_MetaShardedArray, _reduce_sharded)


def _wrap(
    base: Any, layout: _spec.Layout, name: str, dim_str: str, spec_arg: Any
) -> Any:
    """Makes the sharded subclass of one jaxtyping array annotation."""
    out = _MetaShardedArray(
        name,
        (base,),
        dict(
            _jts=layout,
            _jts_rank_fixed=base.index_variadic is None,
            _jts_base=base,
            _jts_verdicts={},
            _jts_last=_NOTHING,
            _jts_dim_str=dim_str,
            _jts_spec_arg=spec_arg,
            _jts_logical=isinstance(layout, _spec.LogicalLayout),
            _jts_twins={},
            _jts_fast=(_NOTHING, None, None, None),
            _jts_twins_by_text={},
            _jts_traced={},  # see hot_path.keep_traced
        ),
    )
    out.__qualname__ = name
    out.__module__ = "jaxtyping_shard"
    return out


def _name(base: Any, plain: str, dim_str: str, spec_arg: Any) -> str:
    # jaxtyping names its class `Float[Array, 'b e']`; ours shows the sharding.
    if not base.__name__.endswith(f"'{plain}']"):  # an extended jaxtyping array
        sharding = dim_str if spec_arg is None else _spec.format_spec(spec_arg)
        return f"{base.__name__[:-1]}, {sharding}]"
    stem = base.__name__[: -len(f"'{plain}']")]
    if spec_arg is None:
        return f"{stem}'{dim_str}']"
    return f"{stem}'{plain}', {_spec.format_spec(spec_arg)}]"


class _MetaShardedDtype(_JaxtypingDtypeMeta):
    """Metaclass of `Float`, `Int`, ...: accepts an optional third argument."""

    def __getitem__(cls, item: Any) -> Any:
        _typeguard.register_once()
        if not isinstance(item, tuple) or len(item) < 2:
            # jaxtyping's own error: "type annotations must now include both..."
            return super().__getitem__(item)
        if len(item) > 3:
            raise ShardingAnnotationError(
                f"{cls.__name__}[...] takes an array type, a dim string and "
                f"optionally a PartitionSpec, but got {len(item)} arguments. For "
                f"example `{cls.__name__}[Array, \"batch embed\", P('data', None)]`."
            )
        array_type, dim_str = item[0], item[1]
        spec_arg = item[2] if len(item) == 3 else None
        where = f"{cls.__name__}[..., {dim_str!r}, ...]"
        logical = is_logical(spec_arg) or _follows.is_marker(spec_arg)
        if len(item) == 3 and not logical:
            validate_spec(spec_arg, where)
        plain_dim_str, inline = _notation.parse_dims(dim_str, where)
        if inline is not None and spec_arg is not None:
            raise ShardingAnnotationError(
                f"{where} gives the sharding twice: inline (`@` in the dim string) "
                f"and as {_spec.format_spec(spec_arg)}. Use one of them: "
                f"{cls.__name__}[Array, {dim_str!r}] or {cls.__name__}[Array, "
                f"{plain_dim_str!r}, {_spec.format_spec(spec_arg)}]."
            )
        _refuse_sharded_base(array_type, where)
        base = super().__getitem__((array_type, plain_dim_str))
        if _follows.is_marker(spec_arg, bound=False):
            if not (
                isinstance(base, type) and issubclass(base, jaxtyping.AbstractArray)
            ):
                raise ShardingAnnotationError(
                    f"{where}: FollowsField needs an array type, not "
                    f"{array_type!r}. Use `jax.Array`."
                )
            return _follows.unbound(cls, base, array_type, dim_str)
        layout: Any = _follows.bound_layout(spec_arg)
        if layout is not None:
            pass  # laid out as the field holding its container
        elif logical:
            layout = logical_layout(plain_dim_str.strip(), spec_arg, where)
        elif spec_arg is not None:
            entries = _spec.entries_of(spec_arg)
            text = _spec.format_spec(spec_arg)
            as_inline = _notation.inline_for_spec(
                plain_dim_str.strip(), entries, spec_arg
            )
            if as_inline:
                text = f"{text} (`{as_inline}`)"
            layout = spec_layout(spec_arg, where, text)
        elif inline is not None:
            layout = inline
        else:
            return base
        return _apply(
            base, layout, plain_dim_str.strip(), dim_str.strip(), spec_arg, where
        )


def _refuse_sharded_base(array_type: Any, where: str) -> None:
    members = (
        get_args(array_type)
        if get_origin(array_type) in _spec.UNION_TYPES
        else (array_type,)
    )
    for member in members:
        if hasattr(member, "_jts"):
            raise ShardingAnnotationError(
                f"{where}: extending the sharded annotation {member!r} would drop "
                "its sharding. Write the whole annotation in one subscription, with "
                "all its dims and its sharding."
            )


def _refuse_long_spec(base: Any, spec: Any) -> None:
    if not isinstance(spec, PartitionSpec) or base.index_variadic is not None:
        return  # inline shardings fit by construction; variadic ranks vary
    if len(spec) > len(base.dims):
        raise ShardingAnnotationError(
            f"{base.__name__}: the sharding {_spec.format_spec(spec)} has "
            f"{len(spec)} entries but the dim string {base.dim_str!r} has only "
            f"{len(base.dims)} dims. Give at most one entry per dim, e.g. "
            f"P({', '.join(['None'] * len(base.dims))})."
        )


def _apply(
    base: Any, layout: Any, plain: str, dim_str: str, spec_arg: Any, where: str
) -> Any:
    def wrap(member: Any) -> Any:
        _refuse_long_spec(member, spec_arg)
        name = _name(member, plain, dim_str, spec_arg)
        return _wrap(member, layout, name, dim_str, spec_arg)

    if isinstance(base, type) and issubclass(base, jaxtyping.AbstractArray):
        return wrap(base)
    if get_origin(base) in _spec.UNION_TYPES:
        members = []
        for member in get_args(base):
            if isinstance(member, type) and issubclass(member, jaxtyping.AbstractArray):
                member = wrap(member)
            members.append(member)
        return Union[tuple(members)]
    raise ShardingAnnotationError(
        f"{where}: a sharding needs an array type, but this annotation is "
        f"{base!r}, which has no sharding. Use `jax.Array` (or jaxtyping's `Array`) "
        "as the first argument."
    )


def _make(jaxtyping_dtype: Any) -> Any:
    out = _MetaShardedDtype(
        jaxtyping_dtype.__name__,
        (jaxtyping_dtype,),
        {"__doc__": f"jaxtyping's `{jaxtyping_dtype.__name__}`, plus a sharding."},
    )
    out.__module__ = (
        "jaxtyping_shard"
        if getattr(typing, "GENERATING_DOCUMENTATION", "") in {"", "jaxtyping_shard"}
        else "builtins"
    )
    return out


BFloat16 = _make(jaxtyping.BFloat16)
Bool = _make(jaxtyping.Bool)
Complex = _make(jaxtyping.Complex)
Complex64 = _make(jaxtyping.Complex64)
Complex128 = _make(jaxtyping.Complex128)
Float = _make(jaxtyping.Float)
Float8e4m3b11fnuz = _make(jaxtyping.Float8e4m3b11fnuz)
Float8e4m3fn = _make(jaxtyping.Float8e4m3fn)
Float8e4m3fnuz = _make(jaxtyping.Float8e4m3fnuz)
Float8e5m2 = _make(jaxtyping.Float8e5m2)
Float8e5m2fnuz = _make(jaxtyping.Float8e5m2fnuz)
Float16 = _make(jaxtyping.Float16)
Float32 = _make(jaxtyping.Float32)
Float64 = _make(jaxtyping.Float64)
Inexact = _make(jaxtyping.Inexact)
Int = _make(jaxtyping.Int)
Int2 = _make(jaxtyping.Int2)
Int4 = _make(jaxtyping.Int4)
Int8 = _make(jaxtyping.Int8)
Int16 = _make(jaxtyping.Int16)
Int32 = _make(jaxtyping.Int32)
Int64 = _make(jaxtyping.Int64)
Integer = _make(jaxtyping.Integer)
Key = _make(jaxtyping.Key)
Num = _make(jaxtyping.Num)
Real = _make(jaxtyping.Real)
Shaped = _make(jaxtyping.Shaped)
UInt = _make(jaxtyping.UInt)
UInt2 = _make(jaxtyping.UInt2)
UInt4 = _make(jaxtyping.UInt4)
UInt8 = _make(jaxtyping.UInt8)
UInt16 = _make(jaxtyping.UInt16)
UInt32 = _make(jaxtyping.UInt32)
UInt64 = _make(jaxtyping.UInt64)

DTYPE_NAMES = (
    "BFloat16 Bool Complex Complex64 Complex128 Float Float8e4m3b11fnuz Float8e4m3fn "
    "Float8e4m3fnuz Float8e5m2 Float8e5m2fnuz Float16 Float32 Float64 Inexact Int Int2 "
    "Int4 Int8 Int16 Int32 Int64 Integer Key Num Real Shaped UInt UInt2 UInt4 UInt8 "
    "UInt16 UInt32 UInt64"
).split()

register_annotation_maker(lambda dims, marker: Shaped[jax.Array, dims, marker])
