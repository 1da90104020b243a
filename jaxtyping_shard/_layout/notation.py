"""Inline sharding in the dim string, in JAX's own notation.

`"batch@data seq heads@model"` shards `batch` over mesh axis `data` and `heads` over
`model`; `"batch@(data,fsdp) embed"` splits `batch` over both axes, in that order,
as JAX prints `8@(data,fsdp)`. `"batch@() embed"` is "sharded over no mesh axis":
the whole array is checked and must be replicated (a dim string without any `@`
is plain jaxtyping, whose sharding is not checked). Dims after a variadic dim
(`"*lead seq@model"`) are counted from the end, so the spec follows the actual rank.

The grammar, per whitespace-separated dim:

    dim        := jaxtyping-dim [ "@" axes ]
    axes       := axis | "(" axis { "," axis } ")" | "()"
    axis       := a Python identifier (a mesh axis name), not `None`

A last token in braces gives the axes a value is unreduced (`U`) or reduced
(`R`) over, as `jax.typeof` prints them after the shape (`float32[4,2]{U:data}`):
`"embed mlp {U:data}"` is `P(None, None, unreduced={'data'})`, and
`"embed mlp {U:(data,fsdp), R:model}"` names both kinds (Explicit axes only):

    pending    := "{" kind ":" axes { "," kind ":" axes } "}"
    kind       := "U" | "R"

Spaces inside `@( ... )` and `{ ... }` are allowed and ignored. Nothing is ever
`eval`ed here.
"""

import re
from typing import Optional

from .._core import compat as _compat
from .._core.errors import ShardingAnnotationError
from . import spec as _spec
from .spec import is_variadic


_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PARENS = re.compile(r"@\(([^()]*)\)")
_FORMS = (
    "Accepted forms: `name@axis` (e.g. `batch@data`) and `name@(a,b)` (e.g. "
    "`batch@(data,fsdp)`), on any dim but a variadic one (`*name`, `...`), and "
    "`name@()` (not sharded, on purpose: checks that the array is replicated); a "
    "mesh axis is a Python identifier and shards at most one dim."
)
_REPLICATED = "()"
_BRACES = re.compile(r"\{([^{}]*)\}")
_PENDING_ITEM = re.compile(r"([UR]):(\([^()]*\)|[^,()]+)(?:,|\Z)")
_PENDING_FORMS = (
    "Write the unreduced / reduced axes as `jax.typeof` prints them, in one last "
    "token: `{U:data}`, `{U:(data,fsdp)}`, `{R:data}` or `{U:data, R:model}`."
)


def _collapse_spaces(dim_str: str) -> str:
    dim_str = _PARENS.sub(lambda m: "@(" + "".join(m.group(1).split()) + ")", dim_str)
    return _BRACES.sub(lambda m: "{" + "".join(m.group(1).split()) + "}", dim_str)


def _parse_pending(token: str, where: str) -> tuple[frozenset, frozenset]:
    """`{U:data, R:model}` as its (unreduced, reduced) mesh axes."""
    inner = token[1:-1] if token.startswith("{") and token.endswith("}") else ""
    found: dict[str, tuple[str, ...]] = {"U": (), "R": ()}
    at = 0
    while inner and at < len(inner):
        match = _PENDING_ITEM.match(inner, at)
        if match is None or match.group(1) in found and found[match.group(1)]:
            break
        found[match.group(1)] = _parse_axes(token, match.group(2), where) or ("",)
        at = match.end()
    if not inner or at < len(inner) or "" in found["U"] + found["R"]:
        raise ShardingAnnotationError(
            f"{where}: `{token}` is not a list of unreduced / reduced axes. "
            + _PENDING_FORMS
        )
    kinds = tuple(k for k, t in (("unreduced", "U"), ("reduced", "R")) if found[t])
    missing = _compat.pending_axes_missing(kinds)
    if missing:
        raise ShardingAnnotationError(f"{where}: `{token}`: {missing}")
    return frozenset(found["U"]), frozenset(found["R"])


def _parse_axes(token: str, axes: str, where: str) -> tuple[str, ...]:
    def bad(problem: str) -> ShardingAnnotationError:
        return ShardingAnnotationError(f"{where}: `{token}` {problem}. {_FORMS}")

    if axes == "":
        raise bad("has nothing after `@`; name the mesh axis, e.g. `batch@data`")
    if "@" in axes:
        raise bad(
            "has `@` twice; to split one dim over several mesh axes write `name@(a,b)`"
        )
    if axes.startswith("("):
        if not axes.endswith(")"):
            raise bad("opens `(` without closing it")
        inner = axes[1:-1]
        if inner == "":
            return ()  # `name@()`: sharded over no mesh axis
        names = tuple(inner.split(","))
        if names[-1] == "":
            raise bad(
                "ends its axis tuple with a comma; write a single axis without "
                "parentheses (`name@axis`)"
            )
    else:
        if ")" in axes or "," in axes:
            raise bad("has `)` or `,` outside `@( ... )`")
        names = (axes,)
    for name in names:
        if name == "None":
            raise bad(
                "names a mesh axis called 'None'. A dim that is not sharded is "
                "written without `@` when another dim carries a sharding (`batch@data "
                "embed`), or as `name@()` (e.g. `embed@()`) to check that the whole "
                "array is replicated"
            )
        if not _AXIS.match(name):
            raise bad(f"names mesh axis {name!r}, which is not a Python identifier")
    if len(set(names)) != len(names):
        raise bad("names the same mesh axis twice")
    return names


def parse_dims(dim_str: str, where: str) -> tuple[str, Optional[_spec.Layout]]:
    """Splits `"batch@data seq"` into jaxtyping's `"batch seq"` and a `Layout`.

    Returns `(dim_str, None)` unchanged when there is no `@`.
    """
    if not isinstance(dim_str, str) or ("@" not in dim_str and "{" not in dim_str):
        return dim_str, None
    tokens = _collapse_spaces(dim_str).split()
    unreduced = reduced = frozenset()
    if tokens and tokens[-1].startswith("{"):
        unreduced, reduced = _parse_pending(tokens.pop(), where)
    for token in tokens:
        if "{" in token or "}" in token:
            raise ShardingAnnotationError(
                f"{where}: `{token}`: braces stand only in the dim string's last "
                f"token. {_PENDING_FORMS}"
            )
    plain: list[str] = []
    entries: list[tuple[str, ...]] = []
    variadic_at: Optional[int] = None
    seen: dict[str, str] = {}
    for index, token in enumerate(tokens):
        dim, at, axes = token.partition("@")
        if at and dim == "":
            raise ShardingAnnotationError(
                f"{where}: `{token}` has no dim before `@`; write the dim's name "
                f"first, e.g. `batch{token}` (or `_{token}` for an anonymous dim). "
                f"{_FORMS}"
            )
        if is_variadic(dim):
            if at and axes != _REPLICATED:
                raise ShardingAnnotationError(
                    f"{where}: `{token}` shards a variadic dim, whose rank is not "
                    "known; shard the dims around it instead, e.g. "
                    f"`{dim} seq@{axes.strip('()').split(',')[0] or 'model'}`. "
                    f"{_FORMS}"
                )
            variadic_at = index
        names = _parse_axes(token, axes, where) if at else ()
        for name in names:
            if name in seen:
                raise ShardingAnnotationError(
                    f"{where}: mesh axis {name!r} shards both `{seen[name]}` and "
                    f"`{token}`; a mesh axis can shard at most one dim. {_FORMS}"
                )
            seen[name] = token
        plain.append(dim)
        entries.append(names)
    if variadic_at is None:
        prefix, suffix = tuple(entries), ()
    else:
        prefix = tuple(entries[:variadic_at])
        suffix = tuple(entries[variadic_at + 1 :])
    for name in sorted(unreduced | reduced):
        if name in seen:
            raise ShardingAnnotationError(
                f"{where}: mesh axis {name!r} shards `{seen[name]}` and is also "
                "unreduced or reduced; an axis a value is unreduced or reduced over "
                f"shards none of its dims. {_PENDING_FORMS}"
            )
    if unreduced & reduced:
        raise ShardingAnnotationError(
            f"{where}: a value cannot be both unreduced and reduced over "
            f"{', '.join(repr(a) for a in sorted(unreduced & reduced))}."
        )
    text = format_inline(plain, prefix, suffix, variadic_at, unreduced, reduced)
    layout = _spec.Layout(prefix, suffix, f"`{text}`", unreduced, reduced)
    return " ".join(plain), layout


def format_inline(
    dims: list[str],
    prefix: _spec.Entries,
    suffix: _spec.Entries,
    variadic_at: Optional[int],
    unreduced: frozenset = frozenset(),
    reduced: frozenset = frozenset(),
) -> str:
    """The inverse of `parse_dims`: dims and entries back to `"batch@data seq"`.

    A layout that shards nothing is written `"batch@() seq"`: without an `@` the
    dim string would be plain jaxtyping, whose sharding is not checked.
    """
    pending = _spec.format_pending(unreduced, reduced)
    if pending:
        plain = (
            format_inline(dims, prefix, suffix, variadic_at)
            if any(prefix + suffix)
            else " ".join(dims)
        )
        return f"{plain} {pending}" if plain else pending
    if dims and not any(prefix) and not any(suffix):
        return " ".join([dims[0] + "@" + _REPLICATED, *dims[1:]])
    out = []
    for index, dim in enumerate(dims):
        if variadic_at is None or index < variadic_at:
            entry = prefix[index] if index < len(prefix) else ()
        elif index == variadic_at:
            entry = ()
        else:
            entry = suffix[index - variadic_at - 1]
        out.append(dim + _format_axes(entry))
    return " ".join(out)


def _format_axes(entry: tuple[str, ...]) -> str:
    if len(entry) == 0:
        return ""
    if len(entry) == 1:
        return "@" + entry[0]
    return "@(" + ",".join(entry) + ")"


def inline_for_spec(
    dim_str: str, entries: _spec.Entries, spec: object = None
) -> Optional[str]:
    """`P('data', None)` on `"batch seq"` as `"batch@data seq"`, when expressible
    (`spec`'s unreduced / reduced axes as a last `{U:data}`).

    Not expressible when an entry would land on or after a variadic dim.
    """
    dims = dim_str.split()
    if len(entries) > len(dims):
        return None
    variadic_at = next((i for i, d in enumerate(dims) if is_variadic(d)), None)
    if variadic_at is not None and any(entries[variadic_at:]):
        return None
    return format_inline(
        dims, entries, (), None, _spec.unreduced_axes(spec), _spec.reduced_axes(spec)
    )
