"""`Used[A]`: a logical annotation read as used, its FSDP names gathered.

A weight is stored split over its FSDP axes and used whole over them (split
only by tensor parallelism). The rules table says which names FSDP shards
(`jts.fsdp(...)`); `Used[A]` is `A` with those names resolved to no mesh axes,
so the stored annotation is written once and the "as used" one derived.
"""

from typing import Any, get_args, get_origin, NoReturn, Union

from .._core.errors import ShardingAnnotationError
from .._layout.logical import AsUsed
from .._layout.spec import LogicalLayout, UNION_TYPES


_UNIONS: dict = {}  # a union annotation -> its "as used" form
_UNIONS_LIMIT = 1024  # as for the physical twins of `dtypes`


class _UsedMeta(type):
    def __getitem__(cls, annotation: Any) -> Any:
        return used_annotation(annotation)

    def __repr__(cls) -> str:
        return "Used"


class Used(metaclass=_UsedMeta):
    """`Used[A]`: the logical annotation `A` as a computation uses the array.

    Every logical name whose rule is [`jaxtyping_shard.fsdp`][] resolves to no
    mesh axes (the weight gathered over FSDP); every other name as `A` says (still
    split for tensor parallelism). Write a weight's annotation once, as stored,
    and take its "as used" form from it: no twin annotation, no second logical
    name.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType
        from jaxtyping import Array
        import jaxtyping_shard as jts
        from jaxtyping_shard import Float

        W = Float[Array, "embed mlp", jts.Logical]
        rules = {"batch": "data", "embed": jts.fsdp("data"), "mlp": "model"}
        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh), jts.axis_rules(rules):
            w = jts.reshard(jnp.zeros((8, 16)), W)
            assert w.sharding.spec == jax.P("data", "model")
            whole = jts.reshard(w, jts.Used[W])   # the all-gather over `data`
            assert whole.sharding.spec == jax.P(None, "model")
            assert isinstance(whole, jts.Used[W]) and not isinstance(whole, W)
        ```

    `Used[A]` is an annotation like any other: checked in signatures (beartype,
    `jts.jaxtyped`, `jts.jit`), and a target of `jts.reshard`. Under rules with
    no `jts.fsdp` name it means what `A` means. [`jaxtyping_shard.as_used`][]
    lays out a whole module so.

    **Raises:** [`jaxtyping_shard.ShardingAnnotationError`][] when written, if
    `A` is not a logical annotation (`jts.Logical`, or Flax NNX metadata): a
    physical one (`P(...)`, inline `@`) names its mesh axes itself, and no
    rule says which of them FSDP holds.
    """

    def __init__(self) -> None:
        raise TypeError("jts.Used is subscripted, not called: jts.Used[Annotation].")


Used.__module__ = "jaxtyping_shard"


def used_annotation(annotation: Any, where: str = "jts.Used[...]") -> Any:
    """`annotation` read as used (the same object for the same annotation).

    An annotation class keeps its "as used" form as an attribute (it lives as
    long as the class); a union's is kept in a bounded table.
    """
    if get_origin(annotation) not in UNION_TYPES:
        made = getattr(annotation, "__dict__", {}).get("_jts_used")
        if made is None:
            made = _one(annotation, where)
            annotation._jts_used = made
        return made
    try:
        return _UNIONS[annotation]
    except (KeyError, TypeError):
        pass
    members = get_args(annotation)
    if not any(hasattr(m, "_jts") for m in members):
        _refuse(annotation, where, "has no sharding")
    out = Union[tuple(_one(m, where) if hasattr(m, "_jts") else m for m in members)]
    if len(_UNIONS) >= _UNIONS_LIMIT:
        _UNIONS.clear()
    _UNIONS[annotation] = out
    return out


def _one(annotation: Any, where: str) -> Any:
    layout = getattr(annotation, "_jts", None)
    if layout is None:
        _refuse(annotation, where, "has no sharding")
    if not isinstance(layout, LogicalLayout):
        _refuse(annotation, where, f"is physical ({getattr(layout, 'text', '')})")
    if layout.used:
        return annotation
    return annotation.dtype[
        annotation.array_type, annotation._jts_dim_str, AsUsed(annotation._jts_spec_arg)
    ]


def _refuse(annotation: Any, where: str, why: str) -> NoReturn:
    name = getattr(annotation, "__name__", None) or repr(annotation)
    raise ShardingAnnotationError(
        f'{where}: {name} {why}. jts.Used derives the "as used" form of a '
        "logical annotation (`jts.Logical`) through the rules' `jts.fsdp(...)` "
        "names; a physical annotation names its mesh axes itself, so write the "
        "gathered one out (`P(None, 'model')`)."
    )
