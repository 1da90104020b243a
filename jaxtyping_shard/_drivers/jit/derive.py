"""`jaxtyping_shard.jit(f, in_shardings="annotations", out_shardings="annotations")`.

`jit`'s shardings read off `f`'s signature through the one tree walk and the one
annotation -> `NamedSharding` path (`_layout.bridge`). A leaf without a sharding
stays unspecified (JAX chooses), never replicated. Shardings are derived per call
signature (tree structures, ranks, mesh) and a `jit` is made per derived set.

A committed argument whose sharding differs from its annotation is refused with a
`ShardingTypeCheckError` naming its path; `reshard_inputs=True` moves it instead.

A call first tries the previous call's entry (`entry.Speculation`): with the same
signature JAX's C++ dispatch runs it with no Python work here. Otherwise the
signature is derived (bound, flattened, keyed) and the call goes through the
entry's `jit` of the function itself (`Entry.tree`) while its sharded leaves are
committed arrays, or else a `jit` over the flat leaves (`Entry.flat`: flattening
an Equinox module again would run its Python flatten per call). `lower`, `trace`
and `eval_shape` use the tree jit and move nothing: a leaf a call would place is
given to them as a `jax.ShapeDtypeStruct` with its derived sharding.
"""

import functools as ft
import inspect
import threading
from collections.abc import Callable
from typing import Any, Optional

import jax
from jax.core import Tracer

from ..._core.modes import mode_reader
from ..._layout import bridge as _bridge
from ..._layout.spec import has_sharding
from ..._rules import scope as _rules
from ..._trees import hints as _hints, like_hint as _like_hint, walk as _tree
from ..._trees.signature import read, Signature
from ..._trees.stacked import lenient
from . import arguments as _arguments
from .entry import (
    BACKOFF,
    BACKOFF_LIMIT,
    Entry,
    flat_leaves,
    Speculation,
    STALE_LIMIT,
)


ANNOTATIONS = "annotations"
_CACHE_LIMIT = 256
_P = inspect.Parameter


def uses_annotations(jit_kwargs: dict) -> bool:
    """Whether `jit`'s keyword arguments ask for shardings from annotations."""
    return "reshard_inputs" in jit_kwargs or any(
        isinstance(jit_kwargs.get(k), str) for k in ("in_shardings", "out_shardings")
    )


class AnnotatedJit:
    """`make(fun, **jit_kwargs)` (`jax.jit`) per derived sharding set, called."""

    def __init__(self, fun: Callable, jit_kwargs: dict, make: Callable) -> None:
        kwargs, self._reshard, stacked, self._derive_in, self._derive_out = (
            _arguments.options(jit_kwargs, ANNOTATIONS)
        )
        self._stacked = lenient(stacked)
        self._fun, self._kwargs, self._make = fun, kwargs, make
        self._sig = inspect.signature(fun)
        self._static_nums, self._static_names = _arguments.statics(self._sig, kwargs)
        self._shape_jit = jax.jit(
            fun,
            static_argnums=tuple(self._static_nums),
            static_argnames=tuple(self._static_names),
        )
        self._plain = make(fun, **kwargs)  # inside another trace
        self._cache: dict = {}
        self._trees: dict = {}  # `Entry.tree`'s jits, one per layout
        self._lock = threading.Lock()
        # Per mode (a loop may time a step with checks on and off in turn): the
        # entry the last ordinary call went through, see `_jit_entry`.
        self._last: dict[str, Speculation] = {}
        self._stale = 0  # speculative calls failed in a row
        # After STALE_LIMIT misses in a row: no speculation for `_pause` more
        # ordinary calls, then one try; a try that misses doubles the pause.
        self._pause, self._window = 0, BACKOFF
        self.__wrapped__ = fun
        ft.update_wrapper(self, fun)

    @ft.cached_property
    def _read(self) -> Signature:
        # The hints, through partials and `__call__`: read at the first call, as
        # the boundary checks read them (and warn about those they cannot).
        return read(self._fun)

    @property
    def _name(self) -> str:
        return self._read.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        last = self._last.get(mode_reader.value)
        if last is not None and not kwargs and last.fits(args):
            # The steady state: the last call's entry, JAX's C++ dispatch (see
            # `_jit_entry`). Anything it refuses goes the ordinary way below,
            # which names a mismatched argument or moves it.
            try:
                out = last.call(args)
            except Exception:  # JAX's C++ cache missed (or the call failed)
                self._stale += 1
                self._last.pop(last.mode, None)
                if self._stale >= STALE_LIMIT:
                    # Back off (the signature alternates, say): a few ordinary
                    # calls, then one more try, so that a steady loop after a
                    # train/eval interleave is speculative again.
                    self._last.clear()
                    self._pause = self._window
                    self._window = min(2 * self._window, BACKOFF_LIMIT)
            else:
                if self._stale:
                    self._stale, self._window = 0, BACKOFF
                return out
        inner, pos, kw, slow = self._prepare(args, kwargs, fast=True)
        if slow is None:
            return inner(*pos, **kw)
        # Every sharded leaf committed, with the shardings (part of the key) the
        # signature was derived and checked for, nothing moved then: JAX's own
        # dispatch runs it. Only when the call fails does the per-leaf loop run,
        # to name a mismatched argument (JAX's "Sharding passed to jit" error, or on an
        # Explicit mesh a check failing in the retrace it causes) or to move it
        # (`reshard_inputs=True`); no mismatch there: the call's own error.
        try:
            return inner(*pos, **kw)
        except Exception as error:
            failure = error
        checked = slow()
        if len(checked) == len(pos) and all(a is b for a, b in zip(checked, pos)):
            raise failure
        return inner(*checked, **kw)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        inner, pos, kw = self.prepared(*args, **kwargs)
        return inner.lower(*pos, **kw)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        inner, pos, kw = self.prepared(*args, **kwargs)
        return inner.trace(*pos, **kw)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        inner, pos, kw = self.prepared(*args, **kwargs)
        return inner.eval_shape(*pos, **kw)

    def deriving_inputs(self) -> "AnnotatedJit":
        """This jit with `in_shardings="annotations"` (itself, if it has it)."""
        if self._derive_in:
            return self
        kwargs = dict(self._kwargs, in_shardings=ANNOTATIONS)
        if self._derive_out:
            kwargs["out_shardings"] = ANNOTATIONS
        return AnnotatedJit(self._fun, kwargs, self._make)

    def prepared(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple, dict]:
        """`(jax.jit with derived shardings, args, kwargs placed as derived)`."""
        inner, pos, kw, _ = self._prepare(args, kwargs, tree=True)
        return inner, pos, kw

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else ft.partial(self, instance)

    def __repr__(self) -> str:
        return f"jaxtyping_shard.jit({self._fun!r}, shardings from annotations)"

    # The derivation.

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        """`[(name, value, is_static), ...]` positionally, and keyword-only ones."""
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        # A keyword a `functools.partial` binds is the partial's to pass, unless
        # the caller gives it.
        partials = self._read.fixed - kwargs.keys()
        pos: list = []
        kw: dict = {}
        for i, (name, param) in enumerate(self._sig.parameters.items()):
            if name in partials:
                continue
            value: Any = bound.arguments.get(name)
            static = i in self._static_nums or name in self._static_names
            if param.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
                pos.append((name, value, static))
            elif param.kind is _P.VAR_POSITIONAL:
                pos.extend((f"{name}[{j}]", v, False) for j, v in enumerate(value))
            elif param.kind is _P.KEYWORD_ONLY:
                kw[name] = (value, static)
            else:
                kw.update((k, (v, k in self._static_names)) for k, v in value.items())
        if self._derive_in:
            dynamic = [k for k, (_, static) in kw.items() if not static]
            if dynamic:
                raise TypeError(
                    f"{self._name}: keyword-only arguments {dynamic} cannot "
                    "take in_shardings (jax.jit applies them to positional "
                    "arguments only). Make them positional, or static."
                )
        return pos, {k: v for k, (v, _) in kw.items()}

    def _prepare(
        self, args: tuple, kwargs: dict, fast: bool = False, tree: bool = False
    ) -> tuple:
        """`(inner, positional values, keyword values, slow)`: `slow` is `None`, or,
        when `fast` and every sharded leaf is committed, the per-leaf placement
        and check, left for the caller to run if JAX refuses the arguments.

        With `tree` (for `lower`, `trace`, `eval_shape`) the values are
        abstract where the call would place them. Otherwise a signature whose
        shardings are all derived is called through a `jit` over its flat leaves
        (`Entry.flat`): JAX then flattens a tuple of arrays, not the modules a
        second time (Equinox modules flatten in Python), and the values are those
        flat leaves."""
        pos, kw = self._bind(args, kwargs)
        flat = [
            None if static else jax.tree_util.tree_flatten(value)
            for _, value, static in pos
        ]
        if any(
            isinstance(leaf, Tracer) for f in flat if f is not None for leaf in f[0]
        ):
            # Inside another trace (jit, grad, vmap): the outer trace places the
            # values; the function's own checks still run on them.
            return self._plain, tuple(value for _, value, _ in pos), kw, None
        mesh = _arguments.call_mesh(flat)
        key = (
            mesh,
            _rules.current(),  # logical annotations resolve through the rules
            tuple(
                ("static", value)
                if f is None
                else (f[1], tuple(map(_arguments.leaf_key, f[0])))
                for (_, value, _), f in zip(pos, flat)
            ),
            tuple(sorted((k, _arguments.hashable(v)) for k, v in kw.items())),
        )
        try:
            entry = self._cache.get(key)
        except TypeError:  # unhashable static values: derive again
            entry, key = None, None
        if entry is None:
            jit_kwargs = dict(self._kwargs)
            in_leaves = None
            if self._derive_in:
                in_leaves, jit_kwargs["in_shardings"] = self._in_shardings(
                    pos, flat, mesh
                )
            # `lower`, `trace`, `eval_shape`: abstract values, nothing moved.
            values = self._place(pos, flat, in_leaves, abstract=tree)
            out_leaves = None
            if self._derive_out:
                jit_kwargs["out_shardings"], out_leaves = self._out_shardings(
                    values, kw, mesh, pos
                )
            flattens = key is not None and self._flattens(kw)
            # A signature whose committed arguments had to be moved (it is keyed
            # on their shardings) is never left to JAX: it would move them
            # silently, and JAX 0.10's dispatch, once it has moved an array from
            # another device order, passes the next one unmoved and crashes.
            moved = any(v is not given for v, (_, given, _) in zip(values, pos))
            entry = Entry(
                self,
                jit_kwargs,
                in_leaves,
                out_leaves,
                _arguments.all_committed(flat, in_leaves) and not moved,
                pos,
                flat,
                flattens,
            )
            if key is not None:
                with self._lock:
                    if len(self._cache) >= _CACHE_LIMIT:
                        self._cache.clear()
                        self._trees.clear()
                    self._cache[key] = entry
        else:
            values = None
        # The flat jit takes the non-static arguments' leaves; the tree jit the
        # arguments as given (and the one for `lower`, `trace`, `eval_shape`).
        flattens = entry.flattens and not tree
        if (
            fast
            and key is not None
            and entry.committed
            and not kwargs
            and not kw
            and len(args) == len(pos)
            and self._may_speculate()
        ):
            # The next call may go straight to this entry's tree jit (see
            # `_jit_entry`): this call fills JAX's C++ cache with its signature.
            flattens = False
            speculation = Speculation(entry, len(pos))
            self._last[speculation.mode] = speculation
        inner = entry.flat() if flattens else entry.tree()

        def pack(values: tuple) -> tuple:
            return flat_leaves(values, pos, flat) if flattens else values

        if values is None and fast and entry.committed:
            given = tuple(value for _, value, _ in pos)
            return (
                inner,
                pack(given),
                kw,
                (lambda: pack(self._place(pos, flat, entry.in_leaves))),
            )
        if values is None:
            values = self._place(pos, flat, entry.in_leaves, abstract=tree)
        return inner, pack(values), kw, None

    def _may_speculate(self) -> bool:
        """Whether this ordinary call may make the next one speculative: not
        while backing off (each call asked counts down the pause)."""
        if self._pause:
            self._pause -= 1
            return False
        return True

    def _flattens(self, kw: dict) -> bool:
        """Whether calls may go through the flat `jit`: every sharding derived, no
        keyword arguments and no donation (whose argument numbers are the
        caller's)."""
        return (
            self._derive_in
            and not kw
            and not any(k.startswith("donate") for k in self._kwargs)
        )

    def _in_shardings(self, pos: list, flat: list, mesh: Any) -> tuple[list, tuple]:
        """`(per positional argument: its leaves' shardings, or None when
        static; in_shardings)`."""
        trees, in_leaves, indivisible = [], [], []
        for (name, value, _), f in zip(pos, flat):
            if f is None:
                in_leaves.append(None)
                continue
            hint = self._read.hint(name.split("[", 1)[0])  # `*args`: `args[j]`
            leaves, plan = _tree.plan_for(value, hint, None, self._stacked)
            anns = _like_hint.annotations(self._read, pos, None, value, hint, plan)
            out = _arguments.leaf_shardings(leaves, anns, plan, mesh, self._name, name)
            indivisible += _arguments.indivisible(name, leaves, out, plan.paths)
            in_leaves.append(out)
            trees.append(jax.tree_util.tree_unflatten(plan.treedef, out))
        _arguments.raise_indivisible(self._name, "arguments", indivisible, mesh)
        return in_leaves, tuple(trees)

    def _out_shardings(
        self, values: tuple, kw: dict, mesh: Any, pos: list
    ) -> tuple[Any, Optional[list]]:
        """`(out_shardings, the sharding of each leaf of the result's walk or
        None)`: the second for the boundary checks (see `Entry`)."""
        hint = self._read.hint("return")
        if hint is None:
            return None, None
        if (
            _hints.leaf_annotation(hint) is not None
            and has_sharding(hint)
            and not _bridge.needs_shape(hint)
        ):
            # One array whose spec the rank alone decides: no trace needed.
            try:
                spec = _bridge.spec_for(hint, None, mesh, f"{self._name} return")
            except Exception:  # its rank depends on the value: trace for it
                spec = None
            if spec is not None:
                one = _bridge.named_sharding(spec, mesh, hint, "return value")
                return one, None  # one array: its own checker's (`jaxtyped`)
        # The result's shapes, from an abstract evaluation (no data moves): each
        # leaf resolved with its shape, as a check of the result will resolve it.
        out = self._shape_jit.eval_shape(*values, **kw)
        leaves, plan = _tree.plan_for(out, hint, None, self._stacked)
        anns = _like_hint.annotations(self._read, pos, values, out, hint, plan)
        shardings = _arguments.leaf_shardings(
            leaves, anns, plan, mesh, self._name, "return"
        )
        indivisible = _arguments.indivisible("return", leaves, shardings, plan.paths)
        _arguments.raise_indivisible(self._name, "results", indivisible, mesh)
        return jax.tree_util.tree_unflatten(plan.treedef, shardings), shardings

    def _place(
        self, pos: list, flat: list, in_leaves: Any, abstract: bool = False
    ) -> tuple:
        return _arguments.place_arguments(
            self._name, pos, flat, in_leaves, self._reshard, abstract
        )
