"""`jts.Like["params"]`: a parameter laid out as another parameter of the function.

`Like["params"]` is `Annotated[Any, LikeOf("params")]`: to a type checker
(beartype, typeguard, `jaxtyped`) and to the tree walk it declares nothing. The
`jit` boundary (`_drivers/jit/boundary.py`) and its derived shardings
(`_drivers/jit/derive.py`) read it here: the leaves under it take the layout
`like=`'s rule gives them (`like.like_layout`) from the value of the argument it
names, in a return annotation too (the ARGUMENT named, as the call received it).
It may be a parameter's whole hint, or an element of a `tuple[...]` hint.
"""

import dataclasses
import typing
from typing import Any, Optional

import jax

from .._core.errors import ShardingAnnotationError
from .._layout import spec as _spec
from . import walk as _tree
from .like import like_layout, Source


@dataclasses.dataclass(frozen=True)
class LikeOf:
    """The metadata `Like[name]` puts in its `Annotated` (`unreduced`: the mesh
    axes of `Like[name, Unreduced(...)]`)."""

    name: str
    unreduced: frozenset = frozenset()


class Unreduced:
    """`jts.Like["params", jts.Unreduced("data")]`: laid out as the parameters,
    and unreduced over the mesh axes given (`P(..., unreduced={"data"})`; over
    axes the parameters are `reduced` on, instead of reduced): the gradients of
    reduced parameters, and an accumulator of them carried through `lax.scan`."""

    def __init__(self, *axes: str):
        if not axes or not all(isinstance(a, str) and a for a in axes):
            raise ShardingAnnotationError(
                f"jts.Unreduced{axes!r}: give one or more mesh axis names, e.g. "
                'jts.Unreduced("data").'
            )
        self.axes = frozenset(axes)

    def __repr__(self) -> str:
        return f"jts.Unreduced({', '.join(repr(a) for a in sorted(self.axes))})"


Unreduced.__module__ = "jaxtyping_shard"


class Like:
    """`opt_state: jts.Like["params"]`: laid out as the parameter `params`.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import optax
        import jaxtyping_shard as jts
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2)
        params = {"w": jax.device_put(jnp.ones((8, 4)),
                                      NamedSharding(mesh, P("data", "model")))}
        opt = optax.adam(1e-3)
        opt_state = jts.sharded_init(opt.init, params, mesh=mesh)

        @jts.jit
        def step(params: dict, opt_state: jts.Like["params"]
                 ) -> tuple[dict, jts.Like["params"]]:
            grads = jax.tree.map(jnp.ones_like, params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        with jax.set_mesh(mesh):
            params, opt_state = step(params, opt_state)
        assert opt_state[0].mu["w"].sharding.spec == P("data", "model")
        ```

    The name of another parameter of the same function. Each subtree of the
    argument with that parameter's structure (an optimiser state's moments) must
    be laid out as that argument (its annotations, its own hint's included, or
    where it has none its arrays' shardings), its leaves of another shape
    (adafactor's factored statistics) and every other leaf (counts) replicated:
    the rule of [`jaxtyping_shard.check_tree`][]'s `like=`. Checked by
    [`jaxtyping_shard.jit`][] and [`jaxtyping_shard.filter_jit`][] at the
    boundary, and used for `in_shardings` / `out_shardings="annotations"`. In a
    return annotation (whole, or an element of `tuple[...]`) it means the layout
    of the ARGUMENT of that name. To `jaxtyped`, beartype and typeguard it is
    `Any`: they check nothing there.

    **Raises:**

    [`jaxtyping_shard.ShardingAnnotationError`][] when written with anything but
    a parameter name (`Like[3]`, `Like[""]`; surrounding spaces are dropped, so
    `Like[" params"]` keeps linters from reading a forward reference, as
    jaxtyping's `" batch"` does); at the first call (or when `jit`
    reads the signature) when the name is not another parameter of the function.
    """

    def __class_getitem__(cls, name: Any) -> Any:
        unreduced: frozenset = frozenset()
        if isinstance(name, tuple) and len(name) == 2:
            if not isinstance(name[1], Unreduced):
                raise ShardingAnnotationError(
                    f"jts.Like[{name[0]!r}, {name[1]!r}]: the second argument is "
                    'a `jts.Unreduced("data")`.'
                )
            name, unreduced = name[0], name[1].axes
        if isinstance(name, str):
            name = name.strip()  # `Like[" params"]`: lint-clean, as jaxtyping's dims
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardingAnnotationError(
                f"jts.Like[{name!r}]: give the name of another parameter of the "
                'same function, as a string: `opt_state: jts.Like["params"]`.'
            )
        return typing.Annotated[Any, LikeOf(name, unreduced)]

    def __init__(self) -> None:
        raise TypeError('jts.Like is written as a hint: `jts.Like["params"]`.')


Like.__module__ = "jaxtyping_shard"


def like_name(hint: Any) -> Optional[str]:
    """The parameter `hint` (a `Like[name]`) names, or `None`."""
    meta = _like_of(hint)
    return None if meta is None else meta.name


def _like_of(hint: Any) -> Optional[LikeOf]:
    if typing.get_origin(hint) is not typing.Annotated:
        return None
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, LikeOf):
            return meta
    return None


def _unreduced_at(hint: Any, prefix: tuple) -> frozenset:
    """The `Unreduced(...)` axes of the `Like` at `prefix` in `hint`."""
    for key in prefix:
        hint = typing.get_args(hint)[key.idx]
    meta = _like_of(hint)
    return frozenset() if meta is None else meta.unreduced


def _pending(source: Source, axes: frozenset) -> Source:
    """`source` unreduced over `axes` (no longer reduced there), for a leaf laid
    out as the parameters' (not a replicated one of the state's own)."""
    if not axes or source.spec is None or source.leaf is None:
        return source
    spec = source.spec
    unreduced = _spec.unreduced_axes(spec) | axes
    reduced = _spec.reduced_axes(spec) - axes
    return source._replace(spec=spec.update(unreduced=unreduced, reduced=reduced))


def like_parts(hint: Any) -> list[tuple[tuple, str]]:
    """`[(key path, name), ...]`: where `Like[name]` stands in `hint`: the whole
    hint (path `()`), or elements of a `tuple[...]` hint, at any depth."""
    name = like_name(hint)
    if name is not None:
        return [((), name)]
    if typing.get_origin(hint) is not tuple:
        return []
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return []
    return [
        ((jax.tree_util.SequenceKey(i),) + path, found)
        for i, element in enumerate(args)
        for path, found in like_parts(element)
    ]


def validate(hints: dict, parameters: list, function: str) -> None:
    """Every `Like[name]` in a function's hints names another of its parameters."""
    for parameter, hint in hints.items():
        for _, name in like_parts(hint):
            if name in parameters and name != parameter:
                continue
            itself = name == parameter
            who = "the return value" if parameter == "return" else f"{parameter!r}"
            raise ShardingAnnotationError(
                f"{function}: {who} is annotated `jts.Like[{name!r}]`, "
                + (
                    "its own name: it must name ANOTHER parameter (the one whose "
                    "layout it follows)"
                    if itself
                    else f"but {function} has no parameter {name!r}"
                )
                + f" (parameters: {', '.join(parameters) or 'none'})."
            )


def targets(hints: dict) -> frozenset:
    """The parameters some `Like[...]` of `hints` names."""
    return frozenset(name for h in hints.values() for _, name in like_parts(h))


def like_plans(signature: Any, named: Any) -> dict:
    """`{parameter: (its leaves, its walk plan)}` for the arguments (`named`:
    `(parameter, value)` pairs) some `Like[...]` of `signature` names, each
    walked under its own hint: parameters declared by a hint (`tuple[...]`,
    `dict[str, ...]`, one array) lay the state out by their annotations, as
    those declared by a module's fields do, traced over Auto axes too."""
    wanted = targets(signature.hints)
    return {n: _tree.plan_for(v, signature.hint(n)) for n, v in named if n in wanted}


def sources(
    value: Any, paths: tuple, leaves: list, hint: Any, arguments: dict, what: str
) -> dict[int, Source]:
    """`{leaf index: Source}` for the leaves of `value` (its walk's `paths` and
    `leaves`) under a `Like[name]` of `hint`, from `arguments[name]`, the
    (leaves, walk plan) of the argument named."""
    out: dict[int, Source] = {}
    for prefix, name in like_parts(hint):
        like = arguments.get(name)
        if like is None:
            continue
        index = [i for i, p in enumerate(paths) if tuple(p[: len(prefix)]) == prefix]
        if not index:
            continue
        subtree = _at(value, prefix)
        found = like_layout(
            tuple(tuple(paths[i][len(prefix) :]) for i in index),
            like,
            subtree,
            [leaves[i] for i in index],
            what,
            lenient=True,
        )
        axes = _unreduced_at(hint, prefix)
        out.update(zip(index, (_pending(s, axes) for s in found)))
    return out


def _at(value: Any, prefix: tuple) -> Any:
    for key in prefix:  # `SequenceKey`s of tuple hints
        value = value[key.idx]
    return value


def annotations(
    signature: Any, pos: list, values: Any, value: Any, hint: Any, plan: Any
) -> tuple:
    """The annotations of one argument's (or the result's) leaves, with those
    under a `jts.Like[name]` of `hint` replaced by the spec `like=`'s rule gives
    them from the argument `name` (`pos`: `(name, value, static)` of the
    positional arguments; `values`: their values as placed, if not those;
    `plan`: the walk plan of `value` under `hint`)."""
    if not like_parts(hint):
        return plan.annotations
    leaves, _ = _tree.plan_for(value, hint)
    if values is None:
        values = [v for _, v, _ in pos]
    likes = like_plans(signature, [(n, v) for (n, _, _), v in zip(pos, values)])
    where = f"jaxtyping_shard.jit({signature.name})"
    found = sources(value, plan.paths, leaves, hint, likes, where)
    out = list(plan.annotations)
    for i, source in found.items():
        if source.spec is not None:  # else the boundary check names it
            out[i] = source.spec
    return tuple(out)
