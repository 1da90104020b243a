"""How reports print what they count and whom: sizes as people read them, and
the reported function's name."""

from typing import Any, Optional


def format_bytes(n: Optional[int]) -> str:
    """`1.5 KiB`: a size as tables print it (`?` when unknown)."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


def function_name(fn: Any) -> str:
    """The name a report gives its function: its own qualified name, else that
    of what it wraps (`functools.wraps`, `jax.jit`), else its type's."""
    for owner in (fn, getattr(fn, "__wrapped__", None)):
        name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None)
        if isinstance(name, str):
            return name
    return type(fn).__name__
