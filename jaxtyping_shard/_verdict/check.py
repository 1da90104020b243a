"""The verdict: does a value's sharding match its annotation's spec?

Four paths, by what is known about the value:

- a concrete `jax.Array`: its `.sharding`, compared with `Sharding.is_equivalent_to`
  and cached per annotation;
- a tracer whose mesh axes are `Explicit`: `jax.typeof(x).sharding`, at trace time;
- a tracer whose mesh has `Auto` axes: `jax.typeof` cannot tell, so a
  `jts_check_sharding` primitive checks when XLA compiles (`auto`);
- a value with no sharding at all (NumPy arrays): it is on one device.

`SpecCheck`: a bare `PartitionSpec`, or a concrete sharding, as something to
check against, for the tree checks where a leaf's annotation is a
`PartitionSpec` or a `NamedSharding` rather than an annotation class (and for
`like=`): `spec_check(spec)` checks the spec on the value's own mesh;
`sharding_check(target)` compares with a concrete sharding, devices and memory
kind included (`is_equivalent_to`).
"""

import functools as ft
from typing import Any, Optional

import jax
import jaxtyping
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.failures import report
from .._core.modes import current_mode, mode_reader
from .._core.site import find_site, how_traced
from .._layout import spec as _spec
from .._layout.validate import spec_layout
from . import (
    auto as _auto,
    compiles as _compiles,
    primitive as _primitive,
    union as _union,
)
from .compare import (
    empty_fits,
    FIX as _FIX,
    missing_axes,
    pending_mismatch,
    pending_refused,
    same_mesh_shape,
    shards_nothing,
    target_types_clash,
    too_long,
    types_message,
)
from .constraints import constrained_spec, placed_spec
from .eager import check_unsharded, eager_message, eager_verdict
from .manual import check_manual


_CACHE_LIMIT = 4096


def check(cls: Any, obj: Any) -> str:
    """Returns "" when `obj`'s sharding matches `cls`'s spec, else the reason."""
    # Tracers first: a tracer's `.sharding` raises an AttributeError whose message
    # walks the whole jaxpr traced so far (O(n) per check, O(n^2) per function).
    if isinstance(obj, Tracer):
        return _report(_check_tracer(cls, obj), cls, obj)
    sharding = getattr(obj, "sharding", None)
    if sharding is None:
        return _report(check_unsharded(cls, obj), cls, obj)
    cache = cls._jts_verdicts
    if type(sharding) is NamedSharding:
        key = sharding if cls._jts_rank_fixed else (sharding, len(obj.shape))
    else:
        key = (sharding, len(obj.shape), _mesh.concrete_context_mesh())
    verdict = cache.get(key)
    if verdict is None:
        verdict = eager_verdict(cls, sharding, len(obj.shape))
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = verdict
    if verdict:
        if type(sharding) is NamedSharding and cls._jts_rank_fixed:
            cls._jts_last = sharding  # see _MetaShardedArray.__instancecheck_str__
        return ""
    if empty_fits(cls, obj.shape):
        return ""
    return _report(eager_message(cls, obj, sharding), cls, obj)


def _report(message: str, cls: Any, obj: Any) -> str:
    if not message:
        return ""
    mode = current_mode()
    if mode == "warn" and _another_member_matches(cls, obj):
        return message  # the checker moves on to that member of the Union
    return report(message, cls, obj, mode)


def _another_member_matches(cls: Any, obj: Any) -> bool:
    """Whether `obj` is checked against a Union of which another member accepts it.

    Checked without side effects (no warning, nothing scheduled); a member whose
    verdict waits for XLA counts as accepting: its own check then runs.
    """
    members = _union.other_members(cls, obj)
    if members.unconditional:
        return True
    for member in members:
        if isinstance(obj, Tracer):
            message = _check_tracer(member, obj, schedule=False)
        elif getattr(obj, "sharding", None) is None:
            message = check_unsharded(member, obj)
        else:
            ok = eager_verdict(member, obj.sharding, len(obj.shape))
            message = "" if ok else "no"
        if not message:
            return True
    return False


_NOUNS = {
    "traced": "this traced {}",
    "differentiated": "this {}, differentiated by `grad`/`jvp`/`vjp` outside `jit`,",
    "vmapped": "this {}, batched by `vmap` outside `jit`,",
    "transformed": "this {}, inside a JAX transformation outside `jit`,",
}


def _noun(obj: Any, what: str = "array") -> str:
    """ "this traced array" under `jit`; what else it is under `grad` or `vmap`."""
    return _NOUNS[how_traced(obj)].format(what)


def _when(obj: Any) -> str:
    return "; checked at trace time" if how_traced(obj) == "traced" else ""


def _check_tracer(cls: Any, obj: Any, schedule: bool = True) -> str:
    aval = jax.typeof(obj)
    ndim = len(aval.shape)
    short = too_long(cls, ndim)
    if short:
        return short
    sharding = getattr(aval, "sharding", None)
    mesh = _mesh.of_aval(aval)
    if mesh is None:
        if shards_nothing(cls, None):
            return ""
        return (
            f"{_noun(obj, 'value')} `{aval.str_short()}` has no mesh (none in its "
            "type, none set with `jax.set_mesh`), so it cannot be sharded as "
            f"{cls._jts.text} as expected by the type hint. Pass arrays placed "
            "on a mesh, or call under `jax.set_mesh(mesh)`."
        )
    missing = missing_axes(cls, mesh)
    if missing:
        return missing
    # Against a concrete sharding: a trace knows no devices, only the mesh's shape.
    target_mesh = getattr(getattr(cls, "_jts_target", None), "mesh", None)
    if target_mesh is not None and not same_mesh_shape(mesh, target_mesh):
        return (
            f"{_noun(obj)} `{aval.str_short()}` is on the mesh "
            f"{_mesh.format_mesh(mesh)}, not on the mesh of {cls._jts.text} "
            f"({_mesh.format_mesh(target_mesh)}) as expected{_when(obj)}"
        )
    # Traced: inside `shard_map` (Manual axes) and `auto_axes` (all Auto) the
    # trace's types are not the arguments'; concrete arrays are compared eagerly.
    traced_types = not _mesh.names_of_type(mesh, AxisType.Manual) and any(
        t != AxisType.Auto for t in mesh.axis_types
    )
    if traced_types and target_types_clash(mesh, target_mesh):
        noun = f"{_noun(obj)} `{aval.str_short()}`"
        whose = f"the mesh of {cls._jts.text}"
        return types_message(noun, mesh, target_mesh, whose, laid_out=False)
    sizes = _mesh.sizes(mesh)
    explicit = _mesh.names_of_type(mesh, AxisType.Explicit)
    auto = _mesh.names_of_type(mesh, AxisType.Auto)
    manual = _mesh.names_of_type(mesh, AxisType.Manual)
    refused = pending_refused(cls, mesh)
    if refused:
        return refused
    if manual:
        return check_manual(cls, obj, aval, mesh, manual)
    actual = _spec.entries_of(sharding.spec) if sharding is not None else ()
    # Unreduced axes hold a pending sum: the same ones as declared, or none. A
    # declared `reduced` must be there; an undeclared one is laid out like a
    # replicated axis (JAX and the eager verdict agree).
    differs, fix = pending_mismatch(cls, getattr(sharding, "spec", None), sizes)
    if differs:
        return (
            f"{_noun(obj)} `{aval.str_short()}` is {differs} (mesh "
            f"{_mesh.format_mesh(mesh)}{_when(obj)}). {fix}"
        )
    if explicit:
        want = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, explicit)
        got = _spec.normalise(actual, ndim, sizes, explicit)
        if want != got and not empty_fits(cls, aval.shape):
            return (
                f"{_noun(obj)} is sharded as `{aval.str_short()}`, not "
                f"{cls._jts.text} as expected by the type hint (mesh "
                f"{_mesh.format_mesh(mesh)}{_when(obj)}). {_FIX}"
            )
    if auto:
        spec = constrained_spec(obj, mesh)
        constrained = _laid_out(cls, obj, aval, mesh, sizes, auto, spec, _BY_CONSTRAINT)
        if constrained:
            return constrained
        spec = placed_spec(obj, mesh)
        known = _laid_out(cls, obj, aval, mesh, sizes, auto, spec, _BY_JIT)
        if known is not None:
            return known  # laid out by `jit`'s derived shardings: nothing for XLA
    if schedule and any(sizes[a] > 1 for a in auto):
        # In a Union, any member whose shape fits may be the one XLA's layout
        # matches (beartype and typeguard stop at the first that passes).
        members = _union.other_members(cls, obj)
        if members.unconditional:
            return ""  # a member without a sharding accepts the value
        members = tuple(m for m in members if not missing_axes(m, mesh))
        _schedule(cls, obj, aval, mesh, current_mode(), members)
    return ""


def _schedule(
    cls: Any, obj: Any, aval: Any, mesh: Any, mode: str, members: tuple = ()
) -> None:
    """Checks `obj`'s sharding once XLA has chosen it (`Auto` mesh axes).

    `members`: the other annotations of a Union that `obj` may match instead.
    """
    _compiles.listen()
    check = _auto.CompileTimeCheck(cls, aval, mesh, find_site(obj, cls), mode, members)
    _primitive.bind(obj, check)
    if _auto.watching.checks is not None:
        _auto.watching.checks.append((obj, check))


# What lays a traced value out where XLA must keep it (see `constraints`), as
# a mismatch names it.
_BY_CONSTRAINT = (
    "a sharding constraint (`jax.lax.with_sharding_constraint` or `jts.reshard`, "
    "which XLA keeps)"
)
_BY_JIT = "the shardings `jit` was given (in_shardings or out_shardings)"


def _laid_out(
    cls: Any, obj: Any, aval: Any, mesh: Any, sizes: dict, auto: Any, spec: Any, by: str
) -> Optional[str]:
    """The verdict, at trace time, on a value laid out as `spec` by what `by`
    names, which XLA keeps (Auto axes; see `constraints`): a constraint's value
    is reported at the constraint, before the values XLA would propagate its
    layout to; an argument or result of a `jit` given derived shardings needs no
    compile-time check. `None` when not known (`spec` is None) or when another
    member of a Union may be the one it matches: left to the compile."""
    if spec is None:
        return None
    ndim = len(aval.shape)
    got = _spec.entries_of(spec)
    want = _spec.normalise(cls._jts.entries(ndim), ndim, sizes, auto)
    if want == _spec.normalise(got, ndim, sizes, auto) or empty_fits(cls, aval.shape):
        return ""
    members = _union.other_members(cls, obj)
    if members or members.unconditional:
        return None
    shown = _spec.format_array(aval.dtype, aval.shape, got)
    return (
        f"{_noun(obj)} is laid out as `{shown}` by {by}, not {cls._jts.text} as "
        f"expected by the type hint (mesh {_mesh.format_mesh(mesh)}{_when(obj)}). "
        f"{_FIX}"
    )


# jaxtyping's own check of "any array, any shape": what a bare spec asks of a
# value before its sharding.
_ANY_ARRAY: Any = jaxtyping.Shaped[jaxtyping.Array, "..."]
_any_array_str = type(_ANY_ARRAY).__instancecheck_str__


class SpecCheck:
    """A bare `PartitionSpec` as something to check values against, as an
    annotation is (`isinstance`, `__instancecheck_str__`): any jax.Array of any
    dtype and rank, sharded as the spec says. What the tree checks use for a
    `PartitionSpec` or `NamedSharding` given as a leaf's annotation; shown in
    messages as the spec (`P('data', None)`). Build one with `spec_check`.
    """

    _jts_rank_fixed = False
    _jts_logical = False
    # A concrete sharding to compare with, devices and memory kind included (see
    # `sharding_check`); None: the spec on the value's own mesh.
    _jts_target: Any = None
    # For `check_tree`'s abstract leaves (`jax.ShapeDtypeStruct`): the dtype and
    # dims a jaxtyping annotation would give, i.e. any.
    dtype = jaxtyping.Shaped
    dim_str = "..."

    def __init__(self, layout: _spec.Layout, target: Any = None):
        self._jts = layout
        self._jts_target = target
        self._jts_verdicts: dict = {}
        self._jts_last: Any = None
        self.__name__ = self.__qualname__ = layout.text

    def __instancecheck__(self, obj: Any) -> bool:
        return self.__instancecheck_str__(obj) == ""

    def __instancecheck_str__(self, obj: Any) -> str:
        return _any_array_str(_ANY_ARRAY, obj) or self._jts_sharding_str(obj)

    def _jts_sharding_str(self, obj: Any) -> str:
        return "" if mode_reader.value == "off" else check(self, obj)

    def __repr__(self) -> str:
        return self.__name__


@ft.lru_cache(maxsize=1024)
def spec_check(spec: PartitionSpec) -> SpecCheck:
    """The `SpecCheck` of a spec (validated here), one per spec."""
    text = _spec.format_spec(spec)
    return SpecCheck(spec_layout(spec, text))


@ft.lru_cache(maxsize=1024)
def sharding_check(target: Any, spec: Optional[PartitionSpec] = None) -> SpecCheck:
    """The `SpecCheck` of a concrete sharding: a value passes when its sharding
    is equivalent to `target` (`is_equivalent_to`: the same shards on the same
    devices, in the same memory). What a `NamedSharding` annotation means, and a
    concrete `like=` leaf's sharding. `spec`: the layout to show, and to check
    traced values with, which know no devices (default: the target's)."""
    layout: PartitionSpec = target.spec if spec is None else spec
    shown = _spec.format_spec(layout)
    mesh = getattr(target, "mesh", None)
    text = (
        f"NamedSharding(mesh {_mesh.format_mesh(mesh)}, {shown})"
        if isinstance(mesh, jax.sharding.Mesh)
        else shown
    )
    return SpecCheck(spec_layout(layout, text, text), target)
