"""Where a check happens: which function, which argument, which line.

Only used on slow paths (a failure, or scheduling a compile-time check), so it may
walk the stack.
"""

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional


_SKIP_DIRS = tuple(
    os.path.dirname(str(m.__file__)) + os.sep
    for m in (
        sys.modules[__name__.rpartition(".")[0]],
        sys.modules.get("jaxtyping"),
        sys.modules.get("beartype"),
        sys.modules.get("typeguard"),
        sys.modules.get("jax"),
    )
    if m is not None and getattr(m, "__file__", None)
)


@dataclass(frozen=True)
class Site:
    function: Optional[str]  # qualified name of the annotated function
    argument: Optional[str]  # parameter name, or None
    is_return: bool
    location: Optional[str]  # "file.py:12", the user code that made the call

    def describe(self) -> str:
        if self.is_return:
            what = "the return value"
            if self.argument is not None:  # a leaf of it, by key path
                what += f" `{self.argument}`"
        elif self.argument is not None:
            what = f"argument `{self.argument}`"
        else:
            what = "a value"
        if self.function is not None:
            what += f" of `{self.function}`"
        if self.location is not None:
            what += f" (first traced at {self.location})"
        return what


class _Naming(threading.local):
    # Set by the tree checks: which function and key path a leaf is checked as.
    current: Optional[tuple[Optional[str], str, bool]] = None


_naming = _Naming()


@contextlib.contextmanager
def naming(function: Optional[str], path: str, is_return: bool) -> Iterator[None]:
    """Names the value checked in this block (a leaf of a tree, by key path)."""
    previous = _naming.current
    _naming.current = (function, path, is_return)
    try:
        yield
    finally:
        _naming.current = previous


def find_site(obj: Any) -> Site:
    """Finds the function and argument that `obj` is being checked as."""
    function = argument = location = None
    is_return = False
    if _naming.current is not None:
        function, argument, is_return = _naming.current
        function = function or "check_tree"
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if function is None:
            if code.co_name == "wrapped_fn_impl":
                found = _from_jaxtyped_frame(frame, obj)
            elif code.co_name in _TYPEGUARD_FRAMES:
                found = _from_typeguard_frame(frame, obj)
            else:
                found = None
            if found is not None:
                function, argument, is_return = found
        filename = code.co_filename
        if (
            location is None
            and not filename.startswith(_SKIP_DIRS)
            and not filename.startswith("<")
        ):
            location = f"{os.path.basename(filename)}:{frame.f_lineno}"
        if function is not None and location is not None:
            break
        frame = frame.f_back
    return Site(function, argument, is_return, location)


def _from_jaxtyped_frame(frame, obj) -> Optional[tuple[str, Optional[str], bool]]:
    # jaxtyping's `jaxtyped` checks parameters, then the return value, from a
    # frame of `wrapped_fn_impl(args, kwargs, bound, memos)` whose local `fn` is the
    # user's function. No public API names the argument being checked, so this is
    # read from that frame; if jaxtyping changes it, messages lose the names only.
    f_locals = frame.f_locals
    fn = f_locals.get("fn")
    bound = f_locals.get("bound")
    if fn is None or bound is None:
        return None
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    if "out" in f_locals and _contains(f_locals["out"], obj):
        return name, None, True
    for arg_name, value in bound.arguments.items():
        if _contains(value, obj):
            return name, arg_name, False
    return name, None, False


_TYPEGUARD_FRAMES = ("check_argument_types_internal", "check_return_type_internal")


def _from_typeguard_frame(frame, obj) -> Optional[tuple[str, Optional[str], bool]]:
    # typeguard's instrumented functions call these helpers with the function's
    # name and its arguments as `{name: (value, annotation)}`.
    f_locals = frame.f_locals
    name = f_locals.get("func_name")
    if not isinstance(name, str):
        return None
    if frame.f_code.co_name == "check_return_type_internal":
        return name, None, True
    for arg_name, pair in (f_locals.get("arguments") or {}).items():
        if isinstance(pair, tuple) and pair and _contains(pair[0], obj):
            return name, arg_name, False
    return name, None, False


def _contains(tree: Any, obj: Any) -> bool:
    if tree is obj:
        return True
    try:
        import jax

        return any(leaf is obj for leaf in jax.tree_util.tree_leaves(tree))
    except Exception:
        return False
