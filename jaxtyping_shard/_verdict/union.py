"""Unions: the other members a value may match, read from the hint being checked.

beartype and typeguard check `Union[A, B]` member by member and stop at the first
that passes. A member whose verdict waits for XLA (`Auto` mesh axes) cannot fail
at trace time, so `A` would always be the one, and a value laid out as `B` would
fail when compiled; likewise in mode `warn`, `A` would warn about a value that
`B` accepts. No API hands the union to its members, so it is read from the
checker's frames (see `_core.site.find_hints`), and the compile-time check then accepts
any member whose shape and dtype fit.
"""

import typing
from typing import Any

import jaxtyping
from jaxtyping._storage import get_shape_memo

from .._core.errors import ShardingAnnotationError
from .._core.site import find_hints
from .._layout.spec import UNION_TYPES


# jaxtyping's metaclass of array annotations; its check is shape and dtype only.
_JaxtypingArrayMeta: Any = type(jaxtyping.Shaped[jaxtyping.Array, "..."])


class Members(tuple):
    """The sharded members a value may match instead; `.unconditional` is True
    when a member without a sharding accepts it, so the union holds whatever the
    sharding."""

    unconditional: bool = False


_NONE = Members()


def other_members(cls: Any, obj: Any) -> Members:
    """The sharded members of the union holding `cls` that accept `obj`'s shape and
    dtype (empty when `cls` is not checked as part of a union)."""
    groups: list = []
    for hint in find_hints(obj):
        found, bare = _unions_holding(hint, cls)
        if bare:
            return _NONE  # `cls` alone may be the hint being checked: no stand-ins
        groups.extend(found)
    if not groups:
        return _NONE
    # `cls` in several unions (arguments holding the same value, or one hint):
    # only members common to all may stand in for it; anything wider could pass
    # a value that one of those unions rejects.
    others = [{_meaning(m) for m in g} for g in groups[1:]]
    candidates = [
        m for m in groups[0] if m is not cls and all(_meaning(m) in g for g in others)
    ]
    out = []
    unconditional = False
    for member in candidates:
        if not _accepts_shape(member, obj):
            continue
        if getattr(member, "_jts_logical", False):
            member = _physical_or_none(member, obj)
            if member is None:
                continue  # no rule makes it a layout here: it does not match
        if hasattr(member, "_jts"):
            out.append(member)
        else:
            unconditional = True
    members = Members(out)
    members.unconditional = unconditional
    return members


def _physical_or_none(member: Any, obj: Any) -> Any:
    """A logical member's physical annotation under the rules in force (the
    annotation class resolves itself: the verdict imports no annotation)."""
    try:
        return member._jts_physical(obj)
    except ShardingAnnotationError:
        return None


def _is_member(node: Any, cls: Any) -> bool:
    """`node` is `cls`, or the logical annotation whose physical twin `cls` is."""
    if node is cls:
        return True
    twins = getattr(node, "_jts_twins_by_text", None)
    return bool(twins) and twins.get(cls._jts.text) is cls


def _meaning(member: Any) -> Any:
    """What a member accepts, comparable across separately written annotations
    (`Float[Array, "b e"]` written twice makes two classes)."""
    if isinstance(member, _JaxtypingArrayMeta):
        layout = getattr(member, "_jts", None)
        dtypes = member.dtypes  # a tuple of names, or jaxtyping's "any" object
        dtypes = tuple(map(str, dtypes)) if isinstance(dtypes, tuple) else dtypes
        return (member.array_type, dtypes, member.dim_str, layout)
    return member


def _unions_holding(hint: Any, cls: Any) -> tuple[list, bool]:
    """The unions in `hint` that have `cls` as a member, and whether `cls` also
    appears outside any union."""
    groups: list = []
    bare = False

    def walk(node: Any, depth: int, in_union: bool) -> None:
        nonlocal bare
        if depth > 16:  # annotations nest shallowly; this bounds odd ones
            return
        if _is_member(node, cls):
            bare = bare or not in_union
            return
        args = typing.get_args(node)
        is_union = typing.get_origin(node) in UNION_TYPES
        if is_union and any(_is_member(a, cls) for a in args):
            groups.append(args)
        leaf = getattr(node, "leaftype", None)  # jaxtyping's `PyTree[T]`
        if leaf is not None:
            walk(leaf, depth + 1, False)
        for arg in args:
            walk(arg, depth + 1, is_union)

    walk(hint, 0, False)
    return groups, bare


def _accepts_shape(member: Any, obj: Any) -> bool:
    """Whether `member` accepts `obj` apart from its sharding, leaving jaxtyping's
    dim bindings as they were (the member is only a candidate)."""
    if isinstance(member, _JaxtypingArrayMeta):
        memos = get_shape_memo()
        saved = [dict(m) for m in memos]
        try:
            return _JaxtypingArrayMeta.__instancecheck_str__(member, obj) == ""
        finally:
            for memo, before in zip(memos, saved):
                memo.clear()
                memo.update(before)
    if isinstance(member, type):
        try:
            return isinstance(obj, member)
        except Exception:  # an odd metaclass: not a member we can vouch for
            return False
    return False  # a typing construct (`list[...]`, a TypeVar): cannot hold an array
