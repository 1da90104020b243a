"""How reports print what they count: sizes as people read them."""

from typing import Optional


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
