"""The layout a collective's operand has before it and after it, in JAX's
notation: `float32[8@data,4]` -> `float32[8,4]` for an all-gather over `data`.

Read from the compiled instruction alone: the operand on each device, the dim
the collective works on (`dimensions=`) and its mesh axes. A dim is printed
with the size it has across the collective's group of devices (`8@data`: 8
rows split over `data`) when the collective gathers or scatters it, and as each
device holds it otherwise (so another axis a dim may be split over, which the
compiled module no longer says, is not shown). `{U:data}`: a partial sum
pending over `data`, as JAX types an `unreduced` value.
"""

from typing import Optional

from .hlo import jax_dtype


def axes_text(axes: tuple[str, ...]) -> str:
    """`data`, `(data,model)`, or `?` when the groups were not read."""
    if not axes:
        return "?"
    return axes[0] if len(axes) == 1 else f"({','.join(axes)})"


def layouts(
    kind: str,
    dtype: str,
    dims: tuple[int, ...],
    dimension: Optional[int],
    axes: tuple[str, ...],
    size: int,
) -> tuple[str, str]:
    """`(before, after)` of one operand (`dims`: on each device, XLA's `dtype`)."""
    name = jax_dtype(dtype)
    over = axes_text(axes)
    local = [str(d) for d in dims]

    def shape(cells: list[str], suffix: str = "") -> str:
        return f"{name}[{','.join(cells)}]{suffix}"

    known = dimension is not None and 0 <= dimension < len(dims)
    if kind == "all-gather" and known:
        assert dimension is not None
        split, whole = list(local), list(local)
        split[dimension] = f"{dims[dimension] * size}@{over}"
        whole[dimension] = str(dims[dimension] * size)
        return shape(split), shape(whole)
    if kind == "reduce-scatter" and known:
        assert dimension is not None
        split = list(local)
        split[dimension] = f"{dims[dimension]}@{over}"
        return shape(local, f"{{U:{over}}}"), shape(split)
    if kind == "all-reduce":
        return shape(local, f"{{U:{over}}}"), shape(local)
    # all-to-all, collective-permute, collective-broadcast, ragged-all-to-all,
    # or a dim not read: each device holds an array of the same shape after.
    return shape(local), shape(local)
