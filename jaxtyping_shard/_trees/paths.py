"""Key paths: how a leaf is named in messages, and the path rules matched on them.

A leaf's path is written with `/` between keys for rule patterns (dict keys,
attribute names, sequence indices: `blocks/1/mlp/weight` for
`model.blocks[1].mlp.weight`). In a pattern, `*` matches within one key, `**`
any number of whole keys (zero included), `?` one character; the whole path must
match. Rules are applied by the walk (`walk.apply_rules`).
"""

import functools as ft
import re
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from .._core.errors import ShardingAnnotationError


def path_name(name: str, path: tuple) -> str:
    return name + jax.tree_util.keystr(path)


def rule_path(path: tuple) -> str:
    """`blocks/1/mlp/weight`: the path that rule patterns are matched against."""
    return "/".join(key_text(k) for k in path)


def key_text(key: Any) -> str:
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def key_id(key: Any) -> Any:
    # An annotation tree may be a dict for a dataclass (`{"w": P("data")}`): keys
    # match by name, whichever container holds them.
    if isinstance(key, GetAttrKey):
        return ("name", key.name)
    if isinstance(key, DictKey):
        return ("name", key.key) if isinstance(key.key, str) else ("key", key.key)
    if isinstance(key, SequenceKey):
        return ("index", key.idx)
    if isinstance(key, FlattenedIndexKey):
        return ("index", key.key)
    return ("other", str(key))


@ft.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> "re.Pattern[str]":
    if not isinstance(pattern, str) or not pattern:
        raise ShardingAnnotationError(
            f"A rule's pattern must be a non-empty string like 'blocks/*/weight', not "
            f"{pattern!r}."
        )
    out = []
    pieces = pattern.split("/")
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if piece == "**":
            out.append("(?:.*)" if last else "(?:[^/]*/)*")
            continue
        text = ""
        for char in piece:
            text += {"*": "[^/]*", "?": "[^/]"}.get(char) or re.escape(char)
        out.append(text if last else text + "/")
    return re.compile("".join(out))
