"""Why a layout cannot be resolved, in words: a mesh axis a stack already holds,
dims competing for one mesh axis under the rules, and how Flax would read the
same names (for the message). The texts `resolve` raises with. `rules` is an
`AxisRules` (imported by `resolve`, not here: one module less in the chain).
"""

import sys
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


# Where a logical layout's text starts when a Flax Linen box (or Linen's logical
# spec tree, `jts.logical_specs`) wrote its names (`_trees/linen.py`): then
# `linen_note` says what Linen would give where this library refuses.
LINEN_SOURCE = "Linen"


def linen_reading(names: Any, rules: Any) -> str:
    """The `PartitionSpec` Flax Linen gives these names under the same table
    (`nn.logical_to_mesh_axes`: the pairs in order of priority, each to its
    name's dim if still unassigned and its mesh axes still free; a dim left
    unassigned is replicated), for messages."""
    result: list = [None] * len(names)
    done = [n is None for n in names]
    for name, candidate in () if rules is None else rules.pairs:
        if name in names:
            i = list(names).index(name)
            taken = {a for e in result if e for a in e}
            if not done[i] and not taken & set(candidate):
                result[i], done[i] = candidate, True
    shown = (
        "None" if not e else repr(e[0]) if len(e) == 1 else repr(e) for e in result
    )
    return f"P({', '.join(shown)})"


def _linen_context() -> Any:
    """Linen's `nn.logical_axis_rules` in force here, if Flax is loaded."""
    spmd = sys.modules.get("flax.core.spmd")
    try:
        return tuple(spmd.get_logical_axis_rules()) if spmd else ()
    except Exception:  # pragma: no cover - another Flax
        return ()


def linen_note(layout: Any, names: Any, rules: Any) -> str:
    """For names a Linen box wrote: what Linen would give where this library
    refuses (a name no rule maps, a rule whose mesh axes are taken, no rules)."""
    if not isinstance(layout, LogicalLayout):
        return ""
    if not layout.text.startswith(LINEN_SOURCE):
        return ""
    note = (
        f" Linen would give {linen_reading(names, rules)} here: "
        "`nn.logical_to_mesh_axes` replicates in silence a dim whose name no rule "
        "maps, or whose rule's mesh axes another dim took; jaxtyping_shard is "
        "stricter (a rule to None replicates on purpose)."
    )
    context = _linen_context() if rules is None else ()
    if context:
        note += (
            f" Linen's `nn.logical_axis_rules` context holds {context!r}, which "
            "is not read implicitly (JAX's caches do not key on it): pass the same "
            "table, `jts.axis_rules(nn.get_logical_axis_rules())` or "
            "`axis_rules=`."
        )
    return note


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
        f"{head}{flax_note(layout, names, rules)}{linen_note(layout, names, rules)}"
        " Fixes: replicate the later dim "
        "with `jts.axis_rules(rules, "
        f"conflicts='first')` (FSDP on a square weight); shard the dims by "
        f"different rules without renaming the size names, "
        f"`Logical({renamed})` with a rule for {other!r}; or give {name!r} a "
        f"fallback list, e.g. {{{name!r}: [..., None]}}."
    )
