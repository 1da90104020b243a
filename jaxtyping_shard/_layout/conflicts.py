"""Why a layout cannot be resolved, in words: a mesh axis a stack already holds,
dims competing for one mesh axis under the rules, and how Flax would read the
same names (for the message). The texts `resolve` raises with. `rules` is an
`AxisRules` (imported by `resolve`, not here: one module less in the chain).
"""

from typing import Any

from jax.sharding import PartitionSpec

from . import spec as _spec
from .spec import LogicalLayout


def held_axes(lead: tuple) -> tuple[tuple[str, int], ...]:
    """`(mesh axis, stacked dim)` for each mesh axis a stack's entries hold."""
    out = []
    for j, entry in enumerate(lead):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.extend((axis, j) for axis in axes)
    return tuple(out)


STACK_FIXES = (
    "Fixes: stack over another mesh axis (`stacked={pattern: ('pipe',)}`, "
    "`jts.Stacked[Block, ('pipe',)]`) or replicate the stack (`1`); or shard "
    "that dim of the layer over another axis."
)


def held_conflict(entries: _spec.Entries, held: tuple, lead: tuple, where: str) -> str:
    """Why a physical layout's `entries` cannot follow its stack ("" if they
    can): one uses a mesh axis the stack holds (`held`, `held_axes(lead)`)."""
    stack = dict(held)
    for i, entry in enumerate(entries):
        for axis in entry:
            if axis in stack:
                return (
                    f"{where} shards its dim {i} over mesh axis {axis!r}, which the "
                    f"leaf's stacked dim {stack[axis]} already holds (the stack "
                    f"{_spec.format_spec(PartitionSpec(*lead))}); a mesh axis "
                    f"can shard at most one dim of an array. {STACK_FIXES}"
                )
    return ""


def flax_reading(layout: LogicalLayout, ndim: int, rules: Any) -> str:
    """The `PartitionSpec` Flax NNX resolves a layout to (`nnx.get_partition_spec`
    under `nnx.logical_axis_rules` with the same table: the last rule of a name
    wins, a name no rule maps is kept as a mesh axis), for messages."""
    if rules is None:
        names = ("None" if n is None else repr(n) for n in layout.names(ndim))
        return f"P({', '.join(names)})"
    table = dict(rules.pairs)
    shown = []
    for name in layout.names(ndim):
        if name is None:
            shown.append("None")
        elif name in table:
            shown.append(rules.show(table[name]))
        else:
            shown.append(repr(name))
    return f"P({', '.join(shown)})"


def flax_note(layout: Any, names: Any, rules: Any) -> str:
    if not isinstance(layout, LogicalLayout) or not layout.direct:
        return ""
    return (
        f" Flax would resolve it to {flax_reading(layout, len(names), rules)} (the "
        "last rule of a name wins; a name no rule maps is passed to the mesh as "
        "an axis), which JAX refuses or which shards otherwise than the rules "
        "say; jaxtyping_shard is stricter."
    )



STACKED = -1  # in `tried`: the candidate's axis is held by a stacked dim


def conflict_message(i, names, tried, rules, layout, where) -> str:
    name = names[i]
    options = rules.candidates(name)
    if not tried and rules.linen:
        k = names.index(name)
        head = (
            f"{where}: dims {k} and {i} are both named `{name}`, and a list of "
            f"pairs gives each rule to the first dim of its name only (as Flax "
            f"Linen reads it), so dim {i} has none under the axis rules "
            f"{rules.describe()}."
        )
    elif len(tried) == 1 and len(options) == 1 and tried[0][2] == STACKED:
        candidate, why, _ = tried[0]
        return (
            f"{where}: dim {i} (`{name}`) resolves to mesh axis "
            f"{rules.show(candidate)} under the axis rules {rules.describe()}, "
            f"but {why} (`stacked=` or `jts.Stacked[...]`); a mesh axis can shard "
            f"at most one dim of an array. {STACK_FIXES} Or give {name!r} a "
            f"fallback list, e.g. {{{name!r}: [..., None]}}, or replicate the "
            "later dim with `jts.axis_rules(rules, conflicts='first')`."
        )
    elif len(tried) == 1 and len(options) == 1 and tried[0][2] is not None:
        candidate, _, k = tried[0]
        axes = " and ".join(repr(a) for a in candidate)
        head = (
            f"{where}: dims {k} (`{names[k]}`) and {i} (`{name}`) both resolve to "
            f"mesh axis {axes} under the axis rules {rules.describe()}; a mesh axis "
            "can shard at most one dim of an array."
        )
    else:
        listed = "; ".join(f"{rules.show(c)}: {why}" for c, why, _ in tried)
        head = (
            f"{where}: dim {i} (`{name}`) fits none of the candidates of its axis "
            f"rule ({listed}) under the axis rules {rules.describe()}."
        )
    other = f"{name}_out" if not name.endswith("_out") else f"{name}2"
    if layout.variadic:
        renamed = f"..., {other!r}, ..."
    else:
        renamed = ", ".join(
            repr(other) if j == i else repr(n) for j, n in enumerate(names)
        )
    return (
        f"{head}{flax_note(layout, names, rules)} Fixes: replicate the later dim "
        "with `jts.axis_rules(rules, "
        f"conflicts='first')` (FSDP on a square weight); shard the dims by "
        f"different rules without renaming the size names, "
        f"`Logical({renamed})` with a rule for {other!r}; or give {name!r} a "
        f"fallback list, e.g. {{{name!r}: [..., None]}}."
    )
