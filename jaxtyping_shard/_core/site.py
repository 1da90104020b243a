"""Where a check happens: which function, which argument (and key path), which line.

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

import jax


_PACKAGE = __name__.partition(".")[0]  # `jaxtyping_shard`, whose every file is skipped
_LIBRARIES = (
    "jaxtyping",
    "beartype",
    "typeguard",
    "jax",
    "equinox",
    "flax",
    "optax",
    "chex",
)


_skip_cache: tuple[int, tuple[str, ...]] = (-1, ())


def _skip_dirs() -> tuple[str, ...]:
    # Read again whenever a module was imported since (a checker may be imported
    # after jaxtyping_shard). Made afresh at every frame, the tuple cost a third
    # of the trace time of a scheduled Auto check (figure 5 of benchmarks/).
    global _skip_cache
    count, dirs = _skip_cache
    if count == len(sys.modules):
        return dirs
    count = len(sys.modules)
    dirs = tuple(
        os.path.dirname(str(m.__file__)) + os.sep
        for m in (
            sys.modules[_PACKAGE],
            *(sys.modules.get(name) for name in _LIBRARIES),
        )
        if m is not None and getattr(m, "__file__", None)
    )
    _skip_cache = (count, dirs)
    return dirs


@dataclass(frozen=True)
class Site:
    function: Optional[str]  # qualified name of the annotated function
    argument: Optional[str]  # parameter name, or None
    is_return: bool
    location: Optional[str]  # "file.py:12", the user code that made the call
    path: str = ""  # `jax.tree_util.keystr` of the value inside its argument

    def describe(self, location: bool = True) -> str:
        """`argument `params['w']` of `f` (first traced at train.py:12)`."""
        if self.is_return:
            if self.path:
                what = f"leaf `{self.path}` of the return value"
            elif self.argument is not None:  # a leaf of it, named by a tree check
                what = f"the return value `{self.argument}`"
            else:
                what = "the return value"
        elif self.argument is not None:
            what = f"argument `{self.argument}{self.path}`"
        else:
            what = "a value"
        if self.function is not None:
            what += f" of `{self.function}`"
        if location and self.location is not None:
            what += f" (first traced at {self.location})"
        return what


def is_library_file(filename: str) -> bool:
    """Whether a frame's file belongs to this library, jaxtyping, a checker, JAX or
    a library built on it (Equinox, Flax, optax, chex)."""
    if filename.startswith("<"):
        return True
    # The demo is this package's own user code: its lines are the ones to show.
    return filename.startswith(_skip_dirs()) and not filename.endswith(_DEMO)


_DEMO = os.sep + "demo.py"


def user_frame(frame: Any) -> Any:
    """The first frame, from `frame` outwards, that is not library code, or None."""
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


class _Naming(threading.local):
    # Set by the tree checks: the function, argument, is-return and key path a
    # leaf is checked as.
    current: Optional[tuple[Optional[str], Optional[str], bool, str]] = None
    # Set by the tree checks while a leaf is checked against a union's members
    # one by one: the union (what `find_hints` reads off a checker's frames).
    hint: Any = None


_naming = _Naming()


@contextlib.contextmanager
def naming(
    function: Optional[str], argument: Optional[str], is_return: bool, path: str
) -> Iterator[None]:
    """Names the value checked in this block (a leaf of a tree, by key path).

    Named as `jaxtyped` names the same value, so that the same failure found by
    both reads the same (and is reported once).
    """
    previous = _naming.current
    _naming.current = (function, argument, is_return, path)
    try:
        yield
    finally:
        _naming.current = previous


@contextlib.contextmanager
def checking_hint(hint: Any) -> Iterator[None]:
    """Says that the checks in this block are of a value against `hint` (a
    union whose members a tree check tries one by one): `find_hints` gives it,
    so that a member's verdict that waits for XLA knows the others."""
    previous = _naming.hint
    _naming.hint = hint
    try:
        yield
    finally:
        _naming.hint = previous


def find_site(obj: Any, cls: Any = None) -> Site:
    """Finds the function, argument and key path that `obj` is being checked as.

    `cls`, the annotation being checked, if given, tells an argument from the
    return value when a function returns an argument unchanged.
    """
    function = argument = location = None
    path = ""
    is_return = False
    if _naming.current is not None:
        function, argument, is_return, path = _naming.current
        function = function or "check_tree"
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if function is None:
            if code.co_name == "wrapped_fn_impl":
                found = _from_jaxtyped_frame(frame, obj, cls)
            elif code.co_name in _TYPEGUARD_FRAMES:
                found = _from_typeguard_frame(frame, obj)
            else:
                found = None
            if found is not None:
                function, argument, is_return, path = found
        if location is None and not is_library_file(code.co_filename):
            location = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        if function is not None and location is not None:
            break
        frame = frame.f_back
    return Site(function, argument, is_return, location, path)


def _from_jaxtyped_frame(
    frame, obj, cls=None
) -> Optional[tuple[str, Optional[str], bool, str]]:
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
    out_path = path_in(f_locals["out"], obj) if "out" in f_locals else None
    hints = getattr(fn, "__annotations__", None) or {}
    if out_path is not None and (cls is None or hints.get("return") is cls):
        return name, None, True, out_path
    if cls is not None:
        for arg_name, value in bound.arguments.items():
            path = path_in(value, obj) if hints.get(arg_name) is cls else None
            if path is not None:
                return name, arg_name, False, path
    if out_path is not None:
        return name, None, True, out_path
    for arg_name, value in bound.arguments.items():
        path = path_in(value, obj)
        if path is not None:
            return name, arg_name, False, path
    return name, None, False, ""


_TYPEGUARD_FRAMES = ("check_argument_types_internal", "check_return_type_internal")


def _from_typeguard_frame(frame, obj) -> Optional[tuple[str, Optional[str], bool, str]]:
    # typeguard's instrumented functions call these helpers with the function's
    # name and its arguments as `{name: (value, annotation)}`.
    f_locals = frame.f_locals
    name = f_locals.get("func_name")
    if not isinstance(name, str):
        return None
    if frame.f_code.co_name == "check_return_type_internal":
        return name, None, True, path_in(f_locals.get("retval"), obj) or ""
    for arg_name, pair in (f_locals.get("arguments") or {}).items():
        if isinstance(pair, tuple) and pair:
            path = path_in(pair[0], obj)
            if path is not None:
                return name, arg_name, False, path
    return name, None, False, ""


def find_hints(obj: Any) -> list:
    """The type hints `obj` may be being checked against, while a checker checks
    it: those of the arguments (and the return value) that hold it. Empty
    otherwise (say, a plain `isinstance` in a function body).

    Read from the checker's frames: typeguard's helpers hold `(value, hint)` pairs;
    jaxtyping's `wrapped_fn_impl` holds the signature and calls `param_fn` /
    `full_fn` to check (its call of `fn` itself runs the body). No frame says which
    of several arguments holding `obj` is being checked, so all are returned. If
    jaxtyping or typeguard change these frames, nothing is found.
    """
    if _naming.hint is not None:
        return [_naming.hint]  # a tree check's union, tried member by member
    frame = sys._getframe(1)
    child = None
    for _ in range(64):  # a check sits a few frames below its checker
        if frame is None:
            return []
        code = frame.f_code
        if code.co_name in _TYPEGUARD_FRAMES:
            return _hints_from_typeguard(frame, obj)
        if code.co_name == "wrapped_fn_impl":
            return _hints_from_jaxtyped(frame, child, obj)
        child, frame = frame, frame.f_back
    return []


def _hints_from_typeguard(frame, obj) -> list:
    f_locals = frame.f_locals
    if frame.f_code.co_name == "check_return_type_internal":
        return [f_locals.get("annotation")]
    return [
        pair[1]
        for pair in (f_locals.get("arguments") or {}).values()
        if isinstance(pair, tuple) and len(pair) == 2 and _contains(pair[0], obj)
    ]


def _hints_from_jaxtyped(frame, child, obj) -> list:
    f_locals = frame.f_locals
    param_fn, full_fn = f_locals.get("param_fn"), f_locals.get("full_fn")
    if child is None or child.f_code not in (
        getattr(param_fn, "__code__", None),
        getattr(full_fn, "__code__", None),
    ):
        return []  # the body is running: this check is not the signature's
    signature = f_locals.get("full_signature")
    bound = f_locals.get("bound")
    if signature is None or bound is None:
        return []
    hints = [
        signature.parameters[name].annotation
        for name, value in bound.arguments.items()
        if name in signature.parameters and _contains(value, obj)
    ]
    if child.f_code is full_fn.__code__ and _contains(f_locals.get("out"), obj):
        hints.append(signature.return_annotation)
    return hints


def _contains(tree: Any, obj: Any) -> bool:
    return path_in(tree, obj) is not None


def path_in(tree: Any, obj: Any) -> Optional[str]:
    """`obj`'s key path inside `tree` (`"['layers'][0].w"`), "" for `tree` itself.

    None when `obj` is not a leaf of `tree`.
    """
    if tree is obj:
        return ""
    try:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    except Exception:
        return None
    for key_path, leaf in leaves:
        if leaf is obj:
            return jax.tree_util.keystr(key_path)
    return None


def how_traced(obj: Any) -> str:
    """What is tracing `obj`, in words for a message: "traced" under `jit` (or any
    staging: `jax.jit(...).trace`, `eval_shape`), else the transformation that made
    a tracer of a concrete value (`grad` with no `jit`, `vmap`, ...).

    No public API says which transformations a tracer belongs to; this reads the
    names of the tracer's trace and its parents (JAX internals: `DynamicJaxprTrace`,
    `JVPTrace`, `LinearizeTrace`, `BatchTrace`, and their `parent_trace`), only to
    word a message.
    """
    kinds = []
    trace = getattr(obj, "_trace", None)
    for _ in range(64):  # bounded: traces nest only as deep as transformations
        if trace is None:
            break
        kinds.append(type(trace).__name__)
        trace = getattr(trace, "parent_trace", None)
    if "DynamicJaxprTrace" in kinds:
        return "traced"
    if "JVPTrace" in kinds or "LinearizeTrace" in kinds:
        return "differentiated"
    if "BatchTrace" in kinds:
        return "vmapped"
    return "transformed"
