"""`einsum`: a contraction whose result layout is read off its operands.

On `Explicit` mesh axes JAX refuses a contraction over a dim that both operands
split (a row-parallel matmul) unless `out_sharding=` says the result's layout.
That layout is not a choice: each result dim keeps the mesh axes its operands
give it, and the contracted axes are summed away. `einsum` derives it, so the
result's annotation is written once, where it is checked (the function's
return), not again at the op.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._layout.spec import entries_of, has_sharding, make_spec
from .reshard import out_sharding


def einsum(subscripts: str, *operands: Any, **kwargs: Any) -> Any:
    """`jnp.einsum`, with `out_sharding=` derived from the operands' layouts.

    Where a contracted dim is split over `Explicit` mesh axes in the operands
    (the row-parallel matmul of tensor parallelism), JAX asks for the result's
    layout; this gives it: every result dim keeps the axes its operands split
    it over, and the contracted axes are summed over (an all-reduce, or a
    reduce-scatter when a later reshard splits the result). Elsewhere (no
    contracted dim split, `Auto` axes, no mesh) it is `jnp.einsum` unchanged.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType
        import jaxtyping_shard as jts

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            h = jax.device_put(jnp.ones((8, 16)), jax.P("data", "model"))
            w = jax.device_put(jnp.ones((16, 4)), jax.P("model", None))
            y = jts.einsum("bm,me->be", h, w)  # summed over `model`
            assert y.sharding.spec == jax.P("data", None)
        ```

    **Arguments:** as `jnp.einsum`: explicit subscripts (`"bsm,me->bse"`), the
    operands, and its keywords. An `out_sharding=` given is used as given (an
    annotation too: `jts.out_sharding` of it). `unreduced=True`: the sum over
    the contracted dims' `Explicit` axes is left pending, as JAX's
    `P(..., unreduced={...})` (a micro-batch's gradient, summed once per step).

    **Returns:** the result.

    **Raises:** [`jaxtyping_shard.ShardingAnnotationError`][] when the
    operands split one result dim over different axes, or put one mesh axis
    on two result dims (an FSDP weight not gathered: lay it out as used first,
    [`jaxtyping_shard.as_used`][]); or, when a layout must be derived, for
    subscripts without `->` or with `...`.
    """
    pending = bool(kwargs.pop("unreduced", False))
    given = kwargs.get("out_sharding")
    if pending and given is not None:
        raise ShardingAnnotationError(
            f"jts.einsum({subscripts!r}): `unreduced=True` derives the result's "
            "layout, and `out_sharding=` gives one: pass one of them (an "
            "`out_sharding=` that is to stay unreduced says so itself, "
            "`P(..., unreduced={...})`)."
        )
    if (
        given is not None
        and has_sharding(given)
        and not isinstance(given, (PartitionSpec, NamedSharding))
    ):
        kwargs["out_sharding"] = out_sharding(given)  # an annotation
    elif "out_sharding" not in kwargs:
        spec = derived_spec(subscripts, operands, pending)
        if spec is not None:
            kwargs["out_sharding"] = spec
    return jnp.einsum(subscripts, *operands, **kwargs)


def derived_spec(
    subscripts: str, operands: tuple, pending: bool = False
) -> Optional[PartitionSpec]:
    """The result layout over `Explicit` axes when a contracted dim is split on
    them; `None` when JAX needs none (or no mesh is known). `pending`: the
    contracted dims' axes are left unreduced."""
    specs = [_explicit_entries(x) for x in operands]
    if all(s is None for s in specs):
        return None
    text = subscripts.replace(" ", "")
    inputs, arrow, output = text.partition("->")
    terms = inputs.split(",")
    where = f"jts.einsum({subscripts!r})"
    if len(terms) != len(operands):
        return None  # jnp.einsum's own error is the clearest
    kept = set(output)
    split_contraction = any(
        entries is not None and letter not in kept and axes
        for term, entries in zip(terms, specs)
        for letter, axes in zip(term, entries or ())
    )
    if not split_contraction:
        return None
    if not arrow or "." in text:
        raise ShardingAnnotationError(
            f"{where}: a contracted dim is split over mesh axes, so the result's "
            "layout must be derived, which needs explicit subscripts without "
            "`...` (`'bsm,me->bse'`); or pass `out_sharding=` yourself."
        )
    per_letter: dict[str, tuple] = {}
    for term, entries in zip(terms, specs):
        for letter, axes in zip(term, entries or ()):
            if letter not in kept or not axes:
                continue
            seen = per_letter.setdefault(letter, axes)
            if seen != axes:
                raise ShardingAnnotationError(
                    f"{where}: the operands split the result dim `{letter}` "
                    f"differently ({_axes(seen)} and {_axes(axes)}); lay them out "
                    "alike first (jts.reshard)."
                )
    holder: dict[str, str] = {}
    for letter in output:
        for axis in per_letter.get(letter, ()):
            if axis in holder:
                raise ShardingAnnotationError(
                    f"{where}: mesh axis {axis!r} would split both result dims "
                    f"`{holder[axis]}` and `{letter}`. An FSDP weight used "
                    "without its gather? Lay it out as used first "
                    "(`jts.as_used(module)`, `jts.reshard(w, jts.Used[W])`)."
                )
            holder[axis] = letter
    entries = tuple(per_letter.get(letter, ()) for letter in output)
    summed: set[str] = set()
    for term, split in zip(terms, specs):
        for letter, axes in zip(term, split or ()):
            if letter not in kept:
                summed.update(tuple(axes))
    return make_spec(entries, summed if pending else ())


def _explicit_entries(x: Any) -> Optional[tuple]:
    """Per dim, the `Explicit` mesh axes `x` is split over; `None` if none are
    known (an `Auto` or no mesh)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return None
    mesh = _mesh.of_aval(aval)
    if mesh is None:
        return None
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    if not explicit:
        return None
    entries = entries_of(aval.sharding.spec)
    entries += ((),) * (aval.ndim - len(entries))
    return tuple(tuple(a for a in axes if a in explicit) for axes in entries)


def _axes(axes: tuple) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)
