"""What a tree check must not pass in silence (issue 33, items 2 and 3).

- `nothing_checked`: the error of a `check_tree` that found array leaves and
  checked none of them (nothing declares their layout), unless the caller says
  that is expected (`may_check_nothing=True`);
- `context_failures`: checked leaves laid out as annotated, on a mesh whose axis
  types the context mesh (`jax.set_mesh`) refuses, so that the first `jit`
  under it would raise. A step of `check_tree` and of the `jts.jit` boundary
  (not of `isinstance`, whose cached pass, the eager hot path, reads no context;
  nor of `place`'s own verification, which keeps an annotation's own mesh).
"""

from typing import Any

import jax
from jax.core import Tracer

from .._core.errors import ShardingTypeCheckError
from .._core.failures import warn_at_user_line
from .._core.modes import current_mode
from .._verdict.compare import context_types_clash, types_message
from . import paths as _paths


def context_failures(
    leaves: list,
    paths: tuple,
    checkers: tuple,
    name: str,
    failed: list,
    unchecked: type,
) -> list:
    """`[(path name, reason), ...]` for the checked leaves (a checker neither
    `None` nor of the class `unchecked`; not in `failed`) on a
    mesh whose axis types clash with the context mesh's (`jax.set_mesh`): laid
    out as annotated, they break the first `jit` under it (issue 33, item 3). A
    tree-level step, so that `isinstance`'s cached pass need not read the context."""
    # JAX's rule reads the mesh `jax.set_mesh` sets, not an old `with mesh:`.
    context = jax.sharding.get_abstract_mesh()
    mode = current_mode()
    if context.empty or mode == "off":
        return []
    out: list = []
    named = {path for path, _ in failed}
    verdicts: dict = {}  # per mesh: one comparison
    for leaf, checker, path in zip(leaves, checkers, paths):
        if checker is None or type(checker) is unchecked:
            continue
        sharding = (
            jax.typeof(leaf).sharding
            if isinstance(leaf, Tracer)
            else getattr(leaf, "sharding", None)
        )
        mesh = getattr(sharding, "mesh", None)
        if mesh is None:
            continue
        clash = verdicts.get(id(mesh))
        if clash is None:
            clash = verdicts[id(mesh)] = (
                context_types_clash(mesh, context),
                mesh,  # kept alive while its id is a key
            )
        where = _paths.path_name(name, path)
        if not clash[0] or where in named:
            continue
        what = "this traced array" if isinstance(leaf, Tracer) else "this array"
        reason = types_message(
            what, mesh, context, "the context mesh", not isinstance(leaf, Tracer)
        )
        if mode == "warn":
            warn_at_user_line(f"{where}: {reason}")
        else:
            out.append((where, reason))
    return out


def refuse_nothing_checked(what: str, counts: Any, tree: Any) -> None:
    """`nothing_checked` raised in mode "check", warned about in "warn", and
    nothing in "off" (where no check of `check_tree` raises)."""
    mode = current_mode()
    if mode == "off":
        return
    found = nothing_checked(what, counts)
    if mode == "warn":
        warn_at_user_line(str(found))
        return
    found.summary = counts.summary(tree)  # type: ignore[attr-defined]
    raise found


def nothing_checked(what: str, counts: Any) -> ShardingTypeCheckError:
    """The error of a tree check that found array leaves and checked none of
    them: each leaf (the first 8) and why nothing declares its layout (`like=`
    declares every leaf, so it never gets here)."""
    why = "no annotation declares one"
    found = counts.unannotated
    lines = [f"  {_paths.path_name(n, p)}: {note or why}" for n, p, note in found[:8]]
    if len(found) > 8:
        lines.append(f"  ... ({len(found)} in all)")
    one = len(found) == 1
    head = (
        f"{what}: "
        + ("its one array leaf is not" if one else f"none of its {len(found)}")
        + ("" if one else " array leaves is")
        + f" checked, so this check would pass whatever {'its' if one else 'their'} "
        f"layout: nothing declares a sharding for {'it' if one else 'them'} (plain "
        "dicts and lists declare none, nor do a third party's classes such as "
        "optax's states)"
    )
    fix = (
        "Declare their layout (a class with annotated fields, a type hint, "
        "`annotations=`, `rules=` or `like=`); if checking nothing is expected "
        "here, say so: `may_check_nothing=True`."
    )
    return ShardingTypeCheckError("\n".join([f"{head}:", *lines, fix]))
