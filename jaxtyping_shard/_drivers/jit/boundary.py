"""Tree checks at a function's boundary: what `jaxtyping_shard.jit` adds.

`checked(fun)` is `fun` with every leaf inside its arguments and its result that
has a sharded annotation checked: from the annotations of its parameters and
return value (type hints such as `dict[str, Float[...]]` or `list[Block]`, read
by `_trees.signature`: through partials and callable objects, one at a time)
and from the field annotations of the dataclasses and Equinox modules inside
them; a value that does not fit its hint (a tuple's length, a TypedDict's keys)
is a failure too. A
parameter annotated as one array (`x: Float[Array, "b e", P("data")]`) is left
to the function's own checker (`jaxtyped`), which checks it already. Under
`jax.jit` the wrapper runs when the function is traced, once per new input
signature, and compiles to nothing: a steady-state call does not run it.
"""

import functools as ft
from collections.abc import Callable
from typing import Any, Optional

from jax.core import Tracer

from ..._annotation.entry import Entry
from ..._core.modes import current_mode
from ..._trees import (
    check_tree as _check_tree,
    hints as _hints,
    leaves as _leaves,
    like_hint as _like_hint,
    paths as _paths,
    silent as _silent,
    walk as _tree,
)
from ..._trees.signature import read
from ..._trees.stacked import lenient


def checked(
    fun: Callable, what: str = "jaxtyping_shard.jit", stacked: Any = None
) -> Callable:
    """`fun`, checking the sharded leaves of its arguments and result (`what`:
    the wrapper messages name, as `what(fun)`; `stacked`: `stacked=`, matched
    against each argument and the result).

    Its `_jts_placed(placed)` is the same check for a `jit` whose
    `in_shardings` and `out_shardings` lay the leaves out as derived: `placed`
    is `{parameter, or "return": the sharding of each of its leaves, or None}`
    (the leaves of `*args` concatenated), and the check of a traced leaf given
    one is decided at trace time from it (`_verdict.constraints.placed`) rather
    than left to the compile."""
    stacked = lenient(stacked)
    own = checks_own_entry(fun)
    info: list = []  # the signature, read at the first call
    entry = Entry(fun, _hints.field_hints)

    def make(placed: dict) -> Callable:
        @ft.wraps(fun)
        def boundary(*args: Any, **kwargs: Any) -> Any:
            if current_mode() == "off":
                return fun(*args, **kwargs)
            entry.check(args, kwargs)  # every logical annotation resolves, first
            if not info:
                info.append(read(fun))
                _like_hint.validate(info[0].hints, _parameters(info[0]), info[0].name)
            signature = info[0]
            name = signature.name
            where = f"{what}({name})"
            failures: list = []
            structure: list = []
            counts = _leaves.Counts()
            arguments = signature.arguments(args, kwargs)
            likes = _likes(signature, arguments, where)
            for param, value, hint in arguments:
                _failures(
                    value, hint, param, name, stacked, counts, failures, structure,
                    likes, placed, own,
                )  # fmt: skip
            if failures or structure:
                raise _leaves.error(f"{where}, arguments", failures, counts, structure)
            out = fun(*args, **kwargs)
            counts = _leaves.Counts()
            hint = signature.hint("return") or signature.unread.get("return")
            _failures(
                out, hint, "return", name, stacked, counts, failures, structure,
                likes, placed, own,
            )  # fmt: skip
            if failures or structure:
                raise _leaves.error(
                    f"{where}, return value", failures, counts, structure
                )
            return out

        if not hasattr(fun, "__qualname__"):  # a partial, a callable object
            boundary.__qualname__ = boundary.__name__ = read(fun).name
        boundary._jts_boundary = True  # type: ignore[attr-defined]
        boundary._jts_placed = make  # type: ignore[attr-defined]
        return boundary

    return make({})


def checks_own_entry(fun: Callable) -> bool:
    """Whether `fun`'s own checker (jaxtyped, beartype, typeguard) is left its
    parameters annotated as one array. Not so for a function whose entry
    checks no traced argument, marked `_jts_unchecked_entry` (the function
    itself, not a wrapper that copied its `__dict__`): `typed_shard_map`,
    whose shard_map lays each argument out by its in_spec before the body's
    checks see it (on Auto axes without a word). The boundary checks those."""
    target = fun.func if isinstance(fun, ft.partial) else fun
    return getattr(target, "_jts_unchecked_entry", None) is not target


def _parameters(signature: Any) -> list:
    return list(signature.parameters.parameters) if signature.parameters else []


def _likes(signature: Any, arguments: list, where: str) -> dict:
    """`{parameter: (its leaves, its walk plan)}` for the parameters some
    `jts.Like[...]` names, with `where` (for messages) under `None`."""
    if not _like_hint.targets(signature.hints):
        return {}
    out: dict = {None: where}
    out.update(_like_hint.like_plans(signature, [(p, v) for p, v, _ in arguments]))
    return out


def _failures(
    value: Any,
    hint: Any,
    name: str,
    function: str,
    stacked: Any,
    counts: _leaves.Counts,
    failures: list,
    structure: list,
    likes: Any = None,
    placed: Optional[dict] = None,
    own: bool = True,
) -> None:
    """Adds the failures of one argument (or the result) to `failures`, and the
    nodes its hints do not fit to `structure` (`placed`: the shardings `jit`
    gives the leaves, see `checked`; `own`: see `checks_own_entry`)."""
    if own and _hints.leaf_annotation(hint) is not None:
        # A parameter (or return) annotated as one array is the function's own
        # checker's to check (jaxtyped, beartype, typeguard); checking it here too
        # would report each of its mismatches twice.
        return
    is_return = name == "return"
    leaves, plan = _tree.plan_for(value, hint, None, stacked)
    checkers = _check_tree.checkers_of(plan, sharded_only=True)
    if likes:
        found = _like_hint.sources(value, plan.paths, leaves, hint, likes, likes[None])
        if found:
            changed = list(checkers)
            for i, source in found.items():
                changed[i] = _check_tree.like_checkers([source])[0]
            checkers = tuple(changed)
    structure += [
        (_paths.path_name(name, path), reason)
        for path, reason in _tree.problems(leaves, plan)
    ]
    if counts.add(name, leaves, plan, checkers):
        mine = placed.get(name) if placed else None
        if mine is not None and len(mine) != len(leaves):
            mine = _on_traced(leaves, mine)
        found = _leaves.leaf_failures(
            leaves, plan.paths, checkers, name, function, is_return, placed=mine
        )
        failures += found
        failures += _silent.context_failures(
            leaves, plan.paths, checkers, name, found, _leaves.Missing
        )


def _on_traced(leaves: list, placed: tuple) -> Optional[tuple]:
    """`placed`, given for the traced leaves only (`filter_jit`: its static leaves
    are no arguments of `jit`), laid on them in order; `None` if they are not as
    many (another walk of the value than the derivation's: left to the compile)."""
    traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tracer)]
    if len(traced) != len(placed):
        return None
    full: list = [None] * len(leaves)
    for i, sharding in zip(traced, placed):
        full[i] = sharding
    return tuple(full)
