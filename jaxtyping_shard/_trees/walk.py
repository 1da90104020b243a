"""The one tree walk: every leaf of a value tree, its key path and its annotation.

Everything that works on whole trees (`check_tree`, `shardings`, the
`jaxtyping_shard.jit` boundary checks, `typed_shard_map`'s pytree specs, and later
sharded init, placement and jit shardings) asks this module, and only this
module, which annotation applies to which leaf.

Interface (reuse it unchanged):

    leaves, plan = plan_for(tree, annotations=None, rules=None)

- `tree`: any pytree of values: arrays, tracers, `jax.ShapeDtypeStruct`s (the
  abstract trees of `jax.eval_shape` / `eqx.filter_eval_shape`), dicts, lists,
  dataclasses registered with `jax.tree_util`, Equinox modules, NamedTuples.
- `annotations`: `None` (only field annotations), a type hint (`MLP`,
  `list[Block]`, `dict[str, Float[Array, "e m", P("data")]]`), or a tree that
  is a prefix of `tree` whose leaves are annotations, `PartitionSpec`s,
  `NamedSharding`s, type hints or `None` (nothing given there: field
  annotations apply).
- `rules`: `None` or a mapping from a path pattern to an annotation,
  `PartitionSpec`, `NamedSharding` or `None` (unannotated on purpose).
- Returns `leaves == jax.tree_util.tree_leaves(tree)` and a `Plan` with, for
  leaf `i`, `plan.paths[i]` (its JAX key path) and `plan.annotations[i]` (the
  annotation that applies, or `None`). `plan.treedef` is the tree's structure.
  Plans are cached by (tree structure, annotations, rules); a warm call costs a
  `tree_flatten` and a dict look-up. `plan.cache` is a dict where consumers
  keep what they derive from a plan (per-leaf checkers, say), under their own
  key, so that it too is computed once per structure. `plan.notes[i]` says why
  leaf `i` has no annotation when a hint above it could not be read;
  `plan.problems` lists the nodes a hint does not fit (a `tuple[A, B]` of
  another length, a dict and its `TypedDict`'s keys), by key path.
- `problems(leaves, plan)`: those, and the leaves that hide arrays from every
  walk (dataclasses not registered as pytrees), computed per call (the plan's
  key cannot tell them from arrays); `refuse_problems` raises them for the
  functions that lay a tree out.
- `walk(tree, annotations, rules)` gives the same as a list of `Leaf` tuples.

Hints are read by `hints`; key paths, patterns and leaf names by `paths`;
stacked layers (`stacked=`, `Stacked[...]`) by `stacked`; path rules here.

Which annotation applies to a leaf, from strongest to weakest: a rule that
matches its path; the nearest enclosing entry of the annotation tree (a
sharding there covers its whole subtree); type hints on the way down (the
parameter's hint, `list[T]` gives `T` to each element, `dict[K, V]` gives `V`,
`tuple[A, B]` by position, a `TypedDict` by key, jaxtyping's `PyTree[T]` gives
`T` to every leaf); field annotations of dataclasses, Equinox modules and
NamedTuples, read one at a time from the value's own class (`reading`: one that
cannot be read declares nothing).

Rule patterns are matched against the leaf's path written with `/` between
keys (`blocks/1/mlp/weight`); see `paths`.
"""

import collections.abc
import dataclasses
import threading
from typing import Any, NamedTuple, Optional

import jax
from jax.sharding import PartitionSpec

from .._core.errors import ShardingAnnotationError
from .._layout.spec import format_spec
from .._layout.validate import validate_spec
from .._rules.scope import current as _current_rules
from . import (
    hints as _hints,
    linen as _linen,
    nnx as _nnx,
    paths as _paths,
    reading as _reading,
)
from .opaque import opaque
from .stacked import key as stacked_key, mark_of, with_leads


class Leaf(NamedTuple):
    path: tuple  # JAX key path
    value: Any
    annotation: Any  # see `leaf_annotation`; None if nothing applies
    note: Optional[str] = None  # why nothing applies: a hint that cannot be read


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    treedef: Any
    paths: tuple
    annotations: tuple
    # Per leaf, `None` or why no annotation applies (a hint above it that cannot
    # be read, see `reading`).
    notes: tuple = ()
    # `(key path, reason)` for each node whose hint does not fit it (a tuple of
    # another length, a TypedDict's keys): what the walk could not apply.
    problems: tuple = ()
    # For consumers to keep what they derive from the plan (per-leaf checkers,
    # shardings), under a key of their own.
    cache: dict = dataclasses.field(default_factory=dict)


class _Walk:
    """What one walk collects: `(path, leaf, annotation, note)` per leaf, and the
    nodes its hints do not fit."""

    def __init__(self) -> None:
        self.items: list = []
        self.problems: list = []
        self.leads: list = []  # per leaf, the dims `Stacked[...]` hints declare


def _children(node: Any) -> Optional[list]:
    """`[(key, child), ...]` one level down, or `None` if `node` is a leaf."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if len(pairs) == 1 and pairs[0][0] == ():
        return None
    return [(path[0], child) for path, child in pairs]


class _Prefix(NamedTuple):
    """A node of an annotation tree, matched against the value tree below it."""

    node: Any


def _child_hints(node: Any, kids: list, hint: Any, where: tuple, walk: _Walk) -> list:
    """One hint per child of `node`, given the hint for `node` itself."""
    if isinstance(hint, _Prefix):
        if _hints.is_annotation_leaf(hint.node):
            hint = hint.node  # None here means: nothing given, fields apply
        else:
            return _match_prefix(node, kids, hint.node, where)
    return _hints.child_hints(node, kids, hint, where, walk.problems)


def _match_prefix(node: Any, kids: list, ann: Any, where: tuple) -> list:
    ann_kids = _children(ann)
    if ann_kids is None:  # pragma: no cover - is_annotation_leaf said otherwise
        return [ann] * len(kids)
    by_key = {_paths.key_id(k): child for k, child in ann_kids}
    out = []
    for (key, _), field_hint in zip(kids, _hints.field_child_hints(node, kids)):
        try:
            given = by_key.pop(_paths.key_id(key))
            # `None`: nothing given here, the field's own annotation applies.
            out.append(field_hint if given is None else _Prefix(given))
        except KeyError:
            raise ShardingAnnotationError(
                f"The annotation tree is not a prefix of the value's tree: at "
                f"`{jax.tree_util.keystr(where)}` the value has key "
                f"`{jax.tree_util.keystr((key,))}`, the annotations "
                f"{sorted(_paths.key_text(k) for k, _ in ann_kids)} do not. Give one "
                "entry per key (`None` where nothing applies)."
            ) from None
    extra = [k for k, v in ann_kids if _paths.key_id(k) in by_key and v is not None]
    if extra:
        raise ShardingAnnotationError(
            f"The annotation tree is not a prefix of the value's tree: at "
            f"`{jax.tree_util.keystr(where)}` it has "
            f"{', '.join('`' + jax.tree_util.keystr((k,)) + '`' for k in extra)}, "
            "which the value lacks."
        )
    return out


def _visit(
    node: Any, path: tuple, hint: Any, walk: _Walk, note: Any, lead: tuple = ()
) -> None:
    if isinstance(hint, _Prefix) and mark_of(hint.node)[1]:
        hint = hint.node  # a `Stacked[...]` given (a parameter's hint): read it
    hint, more = mark_of(hint)  # `Stacked[Block]`: Block, one more dim
    lead += more
    if isinstance(hint, _reading.Unread):
        hint, note = None, str(hint)  # declares nothing; says why below it
    if isinstance(hint, _Prefix) and _linen.is_box(hint.node):
        # A Linen box in the annotation tree: the annotation of the leaf here.
        where = _paths.path_name("annotations", path)
        hint = _Prefix(_linen.annotation(hint.node, where))
    boxed = _linen.is_box(node)
    if (boxed or _nnx.is_variable(node)) and not (
        isinstance(hint, _Prefix) and hint.node is not None
    ):
        # An annotation tree or path rule the caller gives wins over metadata.
        hint = None if isinstance(hint, _Prefix) else hint
        where = _paths.path_name("tree" if boxed else "model", path)
        field = _hints.leaf_annotation(hint)
        if boxed:
            hint = _linen.with_metadata(node, where, hint, field, _nnx.agree)
        else:
            hint = _nnx.with_metadata(node, where, hint, field)
    kids = _children(node)
    if kids is None:
        if isinstance(hint, _Prefix):
            if _linen.is_array_like(hint.node):
                # A boxed tree given as annotations: its unboxed leaves (arrays,
                # ShapeDtypeStructs) declare nothing, as `None` does.
                hint = _Prefix(None)
            elif not _hints.is_annotation_leaf(hint.node):
                raise ShardingAnnotationError(
                    f"The annotation tree is not a prefix of the value's tree: at "
                    f"`{jax.tree_util.keystr(path)}` the value is a leaf but the "
                    f"annotations hold a {type(hint.node).__name__}."
                )
            hint = hint.node
        annotation = _checked_leaf(_hints.leaf_annotation(hint), path)
        walk.items.append((path, node, annotation, note))
        walk.leads.append(lead)
        return
    for (key, child), child_hint in zip(
        kids, _child_hints(node, kids, hint, path, walk)
    ):
        if child is not None:
            _visit(child, (*path, key), child_hint, walk, note, lead)


def _checked_leaf(annotation: Any, path: tuple) -> Any:
    if isinstance(annotation, PartitionSpec):
        validate_spec(annotation, format_spec(annotation))
    return annotation


# Plans.

_plans: dict = {}
_plans_lock = threading.Lock()
_PLAN_LIMIT = 1024


def _annotations_key(annotations: Any) -> Any:
    if annotations is None or _hints.is_annotation_leaf(annotations):
        return ("leaf", annotations)
    leaves, treedef = jax.tree_util.tree_flatten(
        annotations, is_leaf=lambda x: _hints.is_annotation_leaf(x) or _linen.is_box(x)
    )
    keys = (_linen.box_key(x) if _linen.is_box(x) else x for x in leaves)
    return ("tree", treedef, tuple(keys))


def _rules_key(rules: Any) -> Any:
    if rules is None:
        return None
    if isinstance(rules, collections.abc.Mapping):
        return tuple(rules.items())
    return id(rules)  # refused by _apply_rules


def make_plan(tree: Any, annotations: Any = None, rules: Any = None) -> _Walk:
    """The walk itself, uncached: `.items` (`[(path, leaf, annotation, note),
    ...]`) and `.problems`."""
    if annotations is not None:
        if _hints.is_annotation_leaf(annotations):
            _hints.validate_given(annotations, "annotations")
        # A leaf too: given by the caller, it wins over NNX metadata.
        hint = _Prefix(annotations)
    else:
        hint = None
    walk = _Walk()
    _visit(tree, (), hint, walk, None)
    if rules is not None:
        walk.items = apply_rules(walk.items, rules)
    return walk


def plan_for(
    tree: Any, annotations: Any = None, rules: Any = None, stacked: Any = None
) -> tuple:
    """`(leaves, plan)`; see the module docstring (`stacked`: see `stacked`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    try:
        # The rules in force too: a field annotation is compared with a Flax NNX
        # Variable's metadata under them (`_with_metadata`).
        key: Any = (
            treedef,
            _annotations_key(annotations),
            _rules_key(rules),
            _current_rules(),
            stacked_key(stacked),
        )
        plan = _plans.get(key)
    except (TypeError, ValueError):  # unhashable aux data or annotations
        key, plan = None, None
    if plan is None:
        walk = make_plan(tree, annotations, rules)
        items = walk.items
        if len(items) != len(leaves):  # pragma: no cover - a walk bug
            raise AssertionError("tree walk and tree_flatten disagree")
        paths = tuple(x[0] for x in items)
        plan = Plan(
            treedef,
            paths,
            with_leads(paths, tuple(x[2] for x in items), walk.leads, stacked),
            tuple(x[3] for x in items),
            tuple(walk.problems),
        )
        if key is not None:
            with _plans_lock:
                if len(_plans) >= _PLAN_LIMIT:
                    _plans.clear()
                _plans[key] = plan
    return leaves, plan


def like_plan_for(like: Any, tree: Any, stacked: Any = None) -> tuple:
    """`plan_for(like)` for `like=`: a boxed Linen `like` for an unboxed `tree`
    is read unboxed, each box the annotation of its value (`tree`'s key paths
    have no `.value`), so `check_tree(opt_state, like=boxed_params)` works."""
    if _has_box(like) and not _has_box(tree):
        plain = jax.tree_util.tree_map(
            lambda x: x.value if _linen.is_box(x) else x, like, is_leaf=_linen.is_box
        )
        return plan_for(plain, like, None, stacked)
    return plan_for(like, None, None, stacked)


def _has_box(tree: Any) -> bool:
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=_linen.is_box)
    return any(map(_linen.is_box, nodes))


def walk(
    tree: Any, annotations: Any = None, rules: Any = None, stacked: Any = None
) -> list:
    """Every leaf of `tree` as `Leaf(path, value, annotation, note)`, in flatten
    order."""
    leaves, plan = plan_for(tree, annotations, rules, stacked)
    return [Leaf(*x) for x in zip(plan.paths, leaves, plan.annotations, plan.notes)]


def problems(leaves: list, plan: Plan) -> list:
    """`[(key path, reason), ...]`: the nodes the hints do not fit (`plan.problems`)
    and the leaves that hide arrays from the walk (`opaque`)."""
    return [*plan.problems, *opaque(leaves, plan.paths)]


def refuse_problems(leaves: list, plan: Plan, what: str, name: str = "tree") -> None:
    """Raises one `ShardingAnnotationError` listing `problems`, if any: for the
    functions that lay a tree out (`shardings`, `place`, ...), which cannot lay
    out what the walk could not read."""
    found = problems(leaves, plan)
    if found:
        lines = [
            f"  {_paths.path_name(name, path)}: {reason}" for path, reason in found
        ]
        raise ShardingAnnotationError(
            f"{what}: {len(found)} part{'s' if len(found) > 1 else ''} of the tree "
            f"do{'' if len(found) > 1 else 'es'} not fit its type hints, so no layout "
            "is read there:\n" + "\n".join(lines)
        )


def apply_rules(items: list, rules: Any) -> list:
    if not isinstance(rules, collections.abc.Mapping):
        raise ShardingAnnotationError(
            f"rules must be a mapping from a path pattern to an annotation, not "
            f"{type(rules).__name__}."
        )
    compiled = []
    for pattern, value in rules.items():
        _hints.validate_given(value, f"rule {pattern!r}")
        compiled.append((pattern, _paths.compile_pattern(pattern), value))
    used = {pattern: 0 for pattern, _, _ in compiled}
    out = []
    for path, leaf, annotation, note in items:
        text = _paths.rule_path(path)
        hits = [(p, v) for p, regex, v in compiled if regex.fullmatch(text)]
        if len(hits) > 1:
            raise ShardingAnnotationError(
                f"The leaf `{text}` is matched by the rules "
                f"{' and '.join(repr(p) for p, _ in hits)}; a leaf takes one rule. "
                "Narrow the patterns."
            )
        if hits:
            used[hits[0][0]] += 1
            annotation, note = _hints.leaf_annotation(hits[0][1]), None
        out.append((path, leaf, annotation, note))
    unused = [p for p, n in used.items() if n == 0]
    if unused:
        sample = ", ".join(repr(_paths.rule_path(x[0])) for x in items[:6])
        raise ShardingAnnotationError(
            f"The rules {', '.join(repr(p) for p in unused)} match no leaf. Paths "
            f"look like {sample or '(no leaves)'}: keys joined with '/', `*` within "
            "a key, `**` across keys."
        )
    return out
