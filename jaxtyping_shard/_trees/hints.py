"""What a type hint says about the leaves below it (for the one tree walk).

`leaf_annotation` reads one array's annotation out of a hint (`Annotated`,
`Optional`, jaxtyping's `PyTree[T]`, unions of sharded annotations);
`field_hints` reads a class's field annotations, one by one (`reading`: one that
cannot be read declares nothing), and `typeddict_keys` a `TypedDict`'s;
`is_annotation_leaf` says where an annotation tree ends. A union holding a
pytree node gives it the member it is an instance of (`A | QuantArray`: the
container's class, never `A`), and binds its children's `jts.FollowsField`
annotations to the union's sharded array members (`follow`).
"""

import collections
import collections.abc
import dataclasses
import functools as ft
import re
import typing
from typing import Any

import jaxtyping
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import DictKey, GetAttrKey

from .._core.errors import ShardingAnnotationError
from .._core.failures import warn_at_user_line
from .._layout.spec import format_spec, sharded_members, UNION_TYPES
from .._layout.validate import validate_spec
from . import reading as _reading


SEQUENCES = (list, collections.abc.Sequence, collections.abc.MutableSequence)
MAPPINGS = (
    dict,
    collections.abc.Mapping,
    collections.abc.MutableMapping,
    collections.OrderedDict,
    collections.defaultdict,
)
PyTreeMeta: Any = type(jaxtyping.PyTree[int])
# Qualifiers of a TypedDict's keys, peeled off as `Annotated` is.
_QUALIFIERS: tuple[Any, ...] = tuple(
    q
    for q in (
        typing.Required,
        typing.NotRequired,
        getattr(typing, "ReadOnly", None),
    )
    if q is not None
)


def is_annotation_leaf(x: Any) -> bool:
    """Whether `x` ends an annotation tree (not a container to descend into)."""
    if x is None or isinstance(x, (PartitionSpec, NamedSharding, type)):
        return True
    return typing.get_origin(x) is not None or isinstance(x, (str, typing.TypeVar))


@ft.lru_cache(maxsize=512)
def field_hints(cls: type) -> dict:
    """The type hints of a class's fields (`from __future__ import annotations` ok).

    Read one by one (`reading`): a field whose annotation cannot be read maps to
    an `Unread`, which declares nothing, and is warned about, once per class.
    Of the fields an installed package's class defines, only the hints that
    declare a sharding (none of them warned about).
    """
    if not getattr(cls, "__annotations__", None) and not dataclasses.is_dataclass(cls):
        return {}
    hints = _reading.class_hints(cls)
    unread = [v for v in hints.values() if isinstance(v, _reading.Unread)]
    if unread:
        warn_unread(unread, f"`{cls.__module__}.{cls.__qualname__}`", "fields")
    return hints


def warn_unread(unread: list, owner: str, what: str) -> None:
    """The one `ShardingWarning` for the annotations of a class or function that
    cannot be read."""
    listed = "; ".join(str(u) for u in unread)
    warn_at_user_line(
        f"{listed}. An annotation that cannot be read declares nothing: no "
        f"sharding is checked or derived from it (the other {what} of {owner} "
        "are read). Make the names it uses exist at run time (not only under "
        "`TYPE_CHECKING`); `check_tree(..., strict=True)` names the leaves it "
        "leaves unchecked."
    )


def strip(hint: Any) -> Any:
    """`Annotated[T, ...]` -> `T`; `Optional[T]` -> `T`; `NotRequired[T]` -> `T`;
    `Any` and what cannot be read -> None."""
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Annotated or origin in _QUALIFIERS:
            hint = typing.get_args(hint)[0]
        elif origin in UNION_TYPES:
            members = [m for m in typing.get_args(hint) if m is not type(None)]
            if len(members) != 1:
                return hint
            hint = members[0]
        elif hint is typing.Any or isinstance(hint, _reading.Unread):
            return None
        else:
            return hint


def is_typeddict(hint: Any) -> bool:
    """A `TypedDict` class (`typing`'s or `typing_extensions`')."""
    return (
        isinstance(hint, type)
        and issubclass(hint, dict)
        and hasattr(hint, "__required_keys__")
        and hasattr(hint, "__optional_keys__")
    )


def typeddict_keys(hint: type) -> tuple[dict, frozenset]:
    """A TypedDict's field hints and its required keys.

    `Required[...]` / `NotRequired[...]` are read off the resolved hints too:
    under `from __future__ import annotations` Python's own
    `__required_keys__` cannot see them inside the strings.
    """
    fields = field_hints(hint)
    required = set(hint.__required_keys__)
    raw = getattr(hint, "__annotations__", {})
    for key, value in fields.items():
        origin = typing.get_origin(value)
        if isinstance(value, _reading.Unread):  # what its text says, then
            origin = _QUALIFIER_TEXT.get(_qualifier_in(raw.get(key)))
        if origin is typing.NotRequired:
            required.discard(key)
        elif origin is typing.Required:
            required.add(key)
    return fields, frozenset(required)


_QUALIFIER_TEXT = {"NotRequired": typing.NotRequired, "Required": typing.Required}


def _qualifier_in(annotation: Any) -> Any:
    """`NotRequired` / `Required` when an annotation's text starts with one."""
    text = getattr(annotation, "__forward_arg__", annotation)
    if not isinstance(text, str):
        return None
    found = re.match(r"\s*(?:\w+\.)?(NotRequired|Required)\[", text)
    return found.group(1) if found else None


def leaf_annotation(hint: Any) -> Any:
    """What a hint says about one array: an annotation to check, or `None`."""
    hint = strip(hint)
    if isinstance(hint, PyTreeMeta):
        return leaf_annotation(getattr(hint, "leaftype", None))
    if isinstance(hint, (PartitionSpec, NamedSharding)):
        return hint
    if isinstance(hint, type) and issubclass(hint, jaxtyping.AbstractArray):
        return hint
    if typing.get_origin(hint) in UNION_TYPES:
        members = [leaf_annotation(m) for m in typing.get_args(hint)]
        if any(m is not None for m in members) and sharded_members(hint):
            return hint
    return None


def child_hints(node: Any, kids: list, hint: Any, where: tuple, problems: list) -> list:
    """One hint per child of `node` (`kids`: `[(key, child), ...]`), given the type
    hint for `node` itself; a node the hint does not fit goes to `problems` as
    `(where, reason)`, and its children take their fields' hints."""
    hint = strip(hint)
    if typing.get_origin(hint) in UNION_TYPES:
        # `A | QuantArray` holding a container: the container's class, not `A`.
        member = _union_member(node, kids, _containers(hint))
        if member is not None:
            return follow(child_hints(node, kids, member, where, problems), hint)
    if isinstance(hint, PyTreeMeta) or leaf_annotation(hint) is not None:
        return [hint] * len(kids)  # applies to every leaf below
    if is_typeddict(hint):
        return _typeddict_hints(node, kids, hint, where, problems)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return [args[0]] * len(kids)
        if len(args) == len(kids):
            return list(args)
        problems.append(
            (
                where,
                f"{_a(node)} of {len(kids)} elements, where its type hint "
                f"{_shown(hint)} has {len(args)}, so the hint applies to none of "
                "them",
            )
        )
    elif origin in SEQUENCES and args:
        return [args[0]] * len(kids)
    elif origin in MAPPINGS and len(args) == 2:
        return [args[1]] * len(kids)
    elif origin in UNION_TYPES:
        pass  # no member the node is an instance of: its fields' hints
    elif not_the_class(node, hint):
        problems.append((where, _not_the_class(node, hint)))
        return [None] * len(kids)
    return field_child_hints(node, kids)


def not_the_class(node: Any, hint: Any) -> bool:
    """Whether `node` (a pytree node, not a leaf) cannot be the class its hint
    declares: a class whose fields describe its children (a dataclass, an
    Equinox module, a NamedTuple, a class with field annotations), and a node
    that is not an instance of it (a plain dict where `Transformer` is declared:
    what an Orbax restore without a target gives). Its fields' annotations
    would apply to none of the leaves below."""
    if node is None or not isinstance(hint, type) or is_typeddict(hint):
        return False
    if not (
        dataclasses.is_dataclass(hint)
        or (issubclass(hint, tuple) and hasattr(hint, "_fields"))
        or any(getattr(c, "__annotations__", None) for c in hint.__mro__[:-1])
    ):
        return False
    try:
        return not isinstance(node, hint)
    except TypeError:  # a class `isinstance` refuses (a Protocol): not decided
        return False


def _not_the_class(node: Any, hint: type) -> str:
    name = f"{hint.__module__}.{hint.__qualname__}"
    return (
        f"{_a(node)} where its type hint declares the class `{name}`, so its "
        "fields' annotations apply to none of the leaves below and nothing there "
        f"is checked. Pass a `{hint.__qualname__}` (an Orbax restore without a "
        "target gives plain dicts: restore onto a target, such as `jts.abstract`'s "
        "tree of the class)"
    )


def field_child_hints(node: Any, kids: list) -> list:
    hints = field_hints(type(node)) if kids else {}
    return [hints.get(k.name) if isinstance(k, GetAttrKey) else None for k, _ in kids]


def _typeddict_hints(
    node: Any, kids: list, hint: type, where: tuple, problems: list
) -> list:
    """A TypedDict's field hints for the keys of a dict; its missing required keys
    and the keys it does not declare are problems."""
    if not isinstance(node, dict):
        return field_child_hints(node, kids)
    fields, required = typeddict_keys(hint)
    keys = [k.key if isinstance(k, DictKey) else None for k, _ in kids]
    missing = sorted(map(repr, required - set(keys)))
    extra = sorted(repr(k) for k in keys if k not in fields)
    name = _shown(hint)
    if missing:
        problems.append(
            (
                where,
                f"a dict without the required key(s) {', '.join(missing)} of {name}",
            )
        )
    if extra:
        problems.append(
            (where, f"a dict with the key(s) {', '.join(extra)}, which {name} lacks")
        )
    return [fields.get(k) for k in keys]


def _containers(union: Any) -> tuple:
    """A union's members that may be pytree nodes: not array annotations (whose
    `isinstance` would bind jaxtyping's dims), not `PyTree[...]`, not None."""
    out = []
    for member in typing.get_args(union):
        bare = strip(member)
        if bare is None or bare is type(None) or isinstance(bare, PyTreeMeta):
            continue
        if isinstance(bare, type) and issubclass(bare, jaxtyping.AbstractArray):
            continue
        out.append(member)
    return tuple(out)


def follow(hints: list, union: Any) -> list:
    """The children's hints of a container held by a field hinted `union`: each
    `jts.FollowsField` annotation bound to the union's sharded array members (a
    union of them if several); unchanged where the union has none."""
    arrays = [m for m in map(strip, typing.get_args(union)) if hasattr(m, "_jts")]
    if not arrays:
        return hints
    out = []
    for hint in hints:
        bind = getattr(strip(hint), "_jts_follows_bind", None)
        if bind is not None:
            bound = [bind(m) for m in arrays]
            hint = bound[0] if len(bound) == 1 else typing.Union[tuple(bound)]
        out.append(hint)
    return out


def _union_member(node: Any, kids: list, members: tuple) -> Any:
    """The member (of a union's `members`) that `node` is an instance of,
    preferring one whose shape fits (a tuple of its length, a TypedDict with its
    keys)."""
    first = None
    for member in members:
        bare = strip(member)
        cls = dict if is_typeddict(bare) else typing.get_origin(bare) or bare
        try:
            if not (isinstance(cls, type) and isinstance(node, cls)):
                continue
        except Exception:  # a class `isinstance` refuses (a Protocol, say)
            continue
        if _fits(node, kids, bare):
            return member
        first = member if first is None else first
    return first


def _fits(node: Any, kids: list, hint: Any) -> bool:
    if is_typeddict(hint):
        fields, required = typeddict_keys(hint)
        keys = {k.key for k, _ in kids if isinstance(k, DictKey)}
        return required <= keys <= set(fields)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and args and args[-1] is not Ellipsis:
        return len(args) == len(kids)
    return True


def _a(node: Any) -> str:
    return f"a {type(node).__name__}"


def _shown(hint: Any) -> str:
    if isinstance(hint, type):
        return f"`{hint.__qualname__}`"
    return f"`{hint!r}`".replace("typing.", "")


def validate_given(value: Any, what: str) -> None:
    if value is None or isinstance(value, (PartitionSpec, NamedSharding)):
        if isinstance(value, PartitionSpec):
            validate_spec(value, format_spec(value))
        return
    if leaf_annotation(value) is None and not isinstance(value, (type, PyTreeMeta)):
        if typing.get_origin(value) is None:
            raise ShardingAnnotationError(
                f"{what}: {value!r} is not an annotation, a PartitionSpec or a "
                "NamedSharding."
            )
