"""One derived signature of `jts.jit(in_shardings="annotations")`, and the
speculative call that dispatches a steady-state call to it without Python work.

An `Entry` holds the `jit` keyword arguments derived for one call signature
(tree structures, shapes, dtypes, mesh, rules), made into a `jit` of the
function itself (`tree`) or of its arguments' flat leaves (`flat`) when first
used. Entries whose layouts are equal (a call's committed arrays and `lower`'s
`jax.ShapeDtypeStruct`s, say) share one `tree` jit, and so JAX's caches.

**Speculation.** A training loop calls its step with arguments of the same
signature every time, and finding the entry (binding the signature, flattening
the trees, a key over every leaf) costs Python time per leaf. So the last entry
a call went through is called again directly with the next call's arguments
(`Speculation.call`), and only JAX's C++ cache may answer: it flattens the
arguments, finds their signature (tree, types, and each committed array's
sharding, compared by equality, so by devices too) among those the ordinary
way already called the entry's `tree` jit with, and runs that executable, as
for plain `jax.jit`.

On a miss, JAX's Python path would take over: it might trace, and it compares
committed arrays with `in_shardings` as HLO shardings, blind to which devices
hold them, moving an array on another device order (or on one device, for a
replicated annotation) instead of refusing it. Under `jax.no_tracing(True)`
that path raises before it does anything, and the call goes the ordinary way,
which checks each leaf with `is_equivalent_to` and names or moves it. What JAX
does not key its caches on is compared before speculating: the thread being
outside any trace and `jax.disable_jit()`, the mesh of `jax.set_mesh`, and the
rules table (JAX keys on it too; comparing it here saves a miss). The caller
keeps one speculation per mode.
"""

from collections.abc import Callable
from typing import Any

import jax

from ..._core import compat as _compat, mesh as _mesh
from ..._core.modes import mode_reader
from ..._rules import scope as _rules


# After this many speculative calls in a row that JAX's C++ cache could not
# answer (as when the signature alternates between calls), the function backs
# off: it is not called speculatively for BACKOFF ordinary calls, then tried
# once; each try that misses doubles the pause, up to BACKOFF_LIMIT, and a hit
# resets it. An alternating signature then costs one miss per pause; a steady
# one is speculative again after at most BACKOFF_LIMIT calls.
STALE_LIMIT = 8
BACKOFF = 16
BACKOFF_LIMIT = 256


class Entry:
    """One derived signature: its `jit` keyword arguments, made into a `jit` of
    the function itself (`tree`) or of its flat leaves (`flat`) when first used."""

    def __init__(
        self,
        owner: Any,
        kwargs: dict,
        in_leaves: Any,
        out_leaves: Any,
        committed: bool,
        pos: list,
        flat: list,
        flattens: bool,
    ) -> None:
        self._owner, self._kwargs = owner, kwargs
        self.in_leaves, self.committed, self.flattens = in_leaves, committed, flattens
        self._out_leaves = out_leaves
        # Per positional parameter: its static value, or its tree structure and
        # number of leaves (what the flat function rebuilds the arguments from).
        self._layout = tuple(
            (True, value, 0) if f is None else (False, f[1], len(f[0]))
            for (_, value, _), f in zip(pos, flat)
        )
        self._names = tuple(name for name, _, _ in pos)
        self._tree: Any = None
        self._flat: Any = None

    def tree(self) -> Any:
        if self._tree is None:
            # One per layout: entries whose leaves `jit` lays out alike (a call's
            # committed arrays and `lower`'s abstract values, say) share it, and
            # so JAX's caches: a step called once is not compiled again for
            # `jts.collectives` or `lower` on `jax.ShapeDtypeStruct`s.
            key = self._layout_key()
            shared = self._owner._trees
            tree = shared.get(key) if key is not None else None
            if tree is None:
                tree = self._owner._make(self._function(), **self._kwargs)
                if key is not None:
                    tree = shared.setdefault(key, tree)
            self._tree = tree
        return self._tree

    def _layout_key(self) -> Any:
        """What makes this entry's `tree` jit: its keyword arguments (the derived
        shardings among them) and the leaves its boundary is told `jit` lays
        out; `None` when unhashable."""
        kwargs = tuple(
            (k, _flat_key(v)) if k in ("in_shardings", "out_shardings") else (k, v)
            for k, v in sorted(self._kwargs.items())
        )
        key = (
            kwargs,
            self._names,
            _flat_key(self.in_leaves),
            _flat_key(self._out_leaves),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _function(self) -> Callable:
        """The owner's function, its boundary checks told which leaves
        `in_shardings` and `out_shardings` lay out (so decided at trace time, see
        `boundary`): a function of this entry's own, so that no trace of it
        serves another entry, whose leaves `jit` lays out otherwise."""
        fun = self._owner._fun
        variant = getattr(fun, "_jts_placed", None)
        if variant is None or (self.in_leaves is None and self._out_leaves is None):
            return fun
        placed: dict = {}
        for name, shardings in zip(self._names, self.in_leaves or ()):
            if shardings is not None:  # `*args` leaves, one argument after another
                placed.setdefault(name.split("[", 1)[0], []).extend(shardings)
        if self._out_leaves is not None:
            placed["return"] = self._out_leaves
        return variant({k: tuple(v) for k, v in placed.items()})

    def flat(self) -> Any:
        if self._flat is None:
            kwargs = {
                k: v for k, v in self._kwargs.items() if not k.startswith("static_")
            }
            kwargs["in_shardings"] = tuple(
                s
                for (static, _, _), shardings in zip(self._layout, self.in_leaves)
                if not static
                for s in shardings
            )
            self._flat = self._owner._make(
                flat_function(self._function(), self._layout), **kwargs
            )
        return self._flat


class Speculation:
    """The entry the last ordinary call went through, with what JAX's caches do
    not key on (`jax.set_mesh`'s mesh) or what is cheaper to compare here than to
    miss there (rules), as they were then, and the mode it was made in."""

    __slots__ = ("entry", "count", "mesh", "rules", "mode")

    def __init__(self, entry: Entry, count: int) -> None:
        self.entry, self.count = entry, count
        self.mesh = _mesh.set_concrete_mesh()
        self.rules = _rules.current()
        self.mode = mode_reader.value

    def fits(self, args: tuple) -> bool:
        """Whether a call with these positional arguments (and no keyword ones)
        may be made speculatively: outside any trace (a traced call takes the
        function unconstrained) and `jax.disable_jit()`, with the same mesh and
        rules (the caller looks it up by mode)."""
        if len(args) != self.count or not _compat.top_level():
            return False
        if _compat.jit_disabled():  # `fun` would run eagerly
            return False
        # Equal, not only identical: a fresh `axis_rules(same_table)` (or
        # `set_mesh` of an equal mesh) each step is the same (JAX keys its caches
        # on them by equality, too).
        mesh, rules = _mesh.set_concrete_mesh(), _rules.current()
        return (mesh is self.mesh or mesh == self.mesh) and (
            rules is self.rules or rules == self.rules
        )

    def call(self, args: tuple) -> Any:
        jitted = self.entry.tree()
        try:
            # Only JAX's C++ cache may answer: on a miss its Python path would
            # compare committed arguments with `in_shardings` as HLO shardings,
            # blind to which devices hold them (an array on another device order,
            # or on one device for a replicated annotation, would be moved), and
            # might trace. `no_tracing` makes that path raise before it does
            # anything; the ordinary way then checks the arguments
            # (`is_equivalent_to`) and names or moves them.
            with jax.no_tracing(True):
                return jitted(*args)
        except Exception:
            # The miss left an entry in JAX's C++ cache that sends this signature
            # to Python on every later call (refused there each time): dropped,
            # so that the ordinary way's call of this jit fills it properly.
            jitted._clear_cache()
            raise


def _flat_key(tree: Any) -> Any:
    """A tree of shardings (`None` where unspecified) as its structure and leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


def flat_function(fun: Callable, layout: tuple) -> Callable:
    """`fun` taking the flat leaves of its non-static arguments."""

    def flat(*leaves: Any) -> Any:
        args, i = [], 0
        for static, what, n in layout:
            if static:
                args.append(what)
            else:
                args.append(jax.tree_util.tree_unflatten(what, leaves[i : i + n]))
                i += n
        return fun(*args)

    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        try:
            setattr(flat, attr, getattr(fun, attr))
        except AttributeError:
            pass
    return flat


def flat_leaves(values: tuple, pos: list, flat: list) -> tuple:
    """The leaves of the non-static `values`: those already flattened for an
    argument passed on unchanged, flattened again only where it was moved."""
    leaves: list = []
    for value, (_, given, _), f in zip(values, pos, flat):
        if f is not None:
            leaves.extend(f[0] if value is given else jax.tree_util.tree_leaves(value))
    return tuple(leaves)
