"""`like=` over a tree that holds the parameters' structure inside it.

An optimiser state (optax's `ScaleByAdamState(count, mu, nu)`, the tuples of
`chain`, `MultiSteps`, `inject_hyperparams`) holds one or more subtrees with the
structure of the parameters, the moments, beside leaves of its own (step
counts, hyperparameters). `params_shaped` finds those subtrees, as
`optax.tree_map_params` does, by tree structure alone (optax is not imported),
and maps each of their leaves to the parameters' leaf at the same key path
(comparing the structure of array leaves only: an Equinox module's callable
fields are `None` in the `eqx.filter`ed parameters an optax state holds).

`like_layout` is the one rule every `like=` follows (`check_tree`, `shardings`,
`explain`, `sharded_init`, `abstract`, and `jts.Like` at a `jit` boundary): per
leaf of a tree, the spec it must have, read off `like`'s leaf.
"""

import functools
import sys
from typing import Any, NamedTuple, Optional

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._core import mesh as _mesh
from .._core.errors import ShardingAnnotationError
from .._layout import bridge as _bridge, spec as _spec
from .._layout.spec import has_sharding, Lead
from .._verdict.inputs import of_value
from . import paths as _paths
from .stacked import rank_mismatch


class Source(NamedTuple):
    """What one leaf of a tree must be, by `like`'s rule: `spec`, read off
    `leaf` (`like`'s leaf; `None` for a leaf that must be replicated), or, when
    `spec` is `None`, the reason it cannot be laid out (`missing`)."""

    spec: Optional[PartitionSpec]
    leaf: Any = None
    missing: str = ""
    layout: bool = False  # `missing` is about the layout (a rank), not a path


REPLICATED = Source(PartitionSpec())
UNKNOWN = Source(None)  # no `missing`: not known in this trace, left unchecked


class _UnknownLayout(ShardingAnnotationError):
    """An unannotated `like` leaf traced over Auto axes: no layout to follow."""


def array_structure(tree: Any) -> Any:
    """The structure of `tree`'s array leaves, its other leaves as `None`: an
    Equinox module and `eqx.filter(module, eqx.is_array)` (what optax states
    hold) have the same one."""
    return jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda x: x if hasattr(x, "shape") else None, tree)
    )


def params_shaped(tree: Any, like_structure: Any) -> Optional[dict]:
    """`{key ids of a leaf path of tree: key ids of like's leaf}` for every array
    leaf of a subtree of `tree` that holds `like`'s structure (`like_structure`,
    its `array_structure`), as `optax.tree_map_params` finds them; `None` when
    there is none. Held means: that structure, where optax's `MaskedNode` may
    stand for any of its subtrees (`optax.masked`, `multi_transform`: the
    masked-out parameters); when `like` is one array, every array leaf of `tree`
    is one. Derived once per pair of structures."""
    structure = array_structure(tree)
    try:
        found = _matched(structure, like_structure)
    except TypeError:  # a structure that cannot be hashed (unhashable static data)
        found = _matched.__wrapped__(structure, like_structure)
    return dict(found) if found else None


@functools.lru_cache(maxsize=256)
def _matched(structure: Any, like_structure: Any) -> tuple:
    """`params_shaped`'s pairs, from the two structures alone."""
    skeleton = jax.tree_util.tree_unflatten(structure, range(structure.num_leaves))
    if like_structure.num_nodes == 1:  # one array: each array leaf holds it
        flat = jax.tree_util.tree_flatten_with_path(skeleton)[0]
        return tuple((tuple(map(_paths.key_id, path)), ()) for path, _ in flat)
    like_skeleton = jax.tree_util.tree_unflatten(
        like_structure, range(like_structure.num_leaves)
    )
    masked = _masked_node()

    def is_params(node: Any) -> bool:
        return _holds(node, like_skeleton, like_structure, masked)

    pairs = []
    flat = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=is_params)[0]
    for prefix, node in flat:
        if not is_params(node):
            continue
        start = tuple(map(_paths.key_id, prefix))
        for path, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
            ids = tuple(map(_paths.key_id, path))
            pairs.append((start + ids, ids))
    return tuple(pairs)


def _masked_node() -> Optional[type]:
    """optax's `MaskedNode`, if optax is imported (a state holding one was made
    by it); this module does not import optax."""
    optax = sys.modules.get("optax")
    return getattr(optax, "MaskedNode", None) if optax is not None else None


def _holds(node: Any, like: Any, like_structure: Any, masked: Optional[type]) -> bool:
    """Whether `node` (a skeleton of the tree) is `like`'s structure, a
    `MaskedNode` standing for any subtree of it."""
    if jax.tree_util.tree_structure(node) == like_structure:
        return True
    if masked is None:
        return False

    def is_masked(x: Any) -> bool:
        return isinstance(x, masked)

    if not any(map(is_masked, jax.tree_util.tree_leaves(node, is_leaf=is_masked))):
        return False
    try:  # each MaskedNode replaced by `like`'s subtree at its place
        filled = jax.tree_util.tree_map(
            lambda n, sub: sub if is_masked(n) else n, node, like, is_leaf=is_masked
        )
    except (ValueError, TypeError, KeyError):  # `node` is not a prefix of `like`
        return False
    return jax.tree_util.tree_structure(filled) == like_structure


def like_layout(
    paths: tuple,
    like: tuple,
    tree: Any = None,
    leaves: Optional[list] = None,
    what: str = "check_tree(like=...)",
    lenient: bool = False,
) -> list[Source]:
    """Per leaf (`paths`, `leaves`) of `tree`: its `Source` by `like`'s rule
    (`like`: its leaves and walk plan, `walk.plan_for(like)`; a stacked leaf's
    annotation there is a `Lead`, as `stacked=` or `jts.Stacked` made it).

    A tree with `like`'s key paths: each leaf as `like`'s leaf at the same path.
    Otherwise (an optimiser state holding `like`'s structure, `params_shaped`):
    each leaf of a params-shaped subtree as its parameter, unless its shape
    differs (adafactor's factored statistics); every other leaf replicated, in a
    state with no params-shaped subtree too (`sgd(schedule)`), unless the tree
    shares some of `like`'s paths (then it is matched by path). `lenient`: a leaf whose
    `like` leaf is unannotated and traced over Auto axes is `UNKNOWN` (left
    unchecked, as a hint that declares nothing) rather than an error."""
    like_leaves, like_plan = like
    entries = []
    rows = zip(like_leaves, like_plan.annotations, like_plan.paths, strict=True)
    for leaf, annotation, path in rows:
        lead: tuple = ()
        if isinstance(annotation, Lead):
            lead, annotation = annotation.lead, annotation.inner
        entries.append((leaf, annotation, path, lead))
    by_path = {tuple(map(_paths.key_id, e[2])): e for e in entries}
    ids = [tuple(map(_paths.key_id, path)) for path in paths]
    state = None
    if tree is not None and any(i not in by_path for i in ids):
        # Not the parameters' structure: an optimiser state holding it (moments
        # laid out as the parameters, every other leaf replicated).
        like_tree = jax.tree_util.tree_unflatten(like_plan.treedef, like_leaves)
        state = params_shaped(tree, array_structure(like_tree))
        if (
            state is None
            and not any(i in by_path for i in ids)
            and not _has_param_shape(leaves, like_leaves)
        ):
            # No moments at all (`sgd(schedule)`, `noisy_sgd`): by the same rule
            # every leaf is replicated. A tree sharing some of `like`'s paths is
            # matched by path, and a leaf `like` lacks is named; so is every
            # leaf of a tree holding a parameter's shape outside its structure
            # (a restore into plain dicts: moments that lost their layout).
            state = {}
    out: list[Source] = []
    for i, path in enumerate(paths):
        try:
            found = _source(
                i,
                path,
                ids[i],
                entries,
                by_path,
                state,
                leaves,
                what,
                like_plan.treedef,
            )
            out.append(found)
        except _UnknownLayout:
            if not lenient:
                raise
            out.append(UNKNOWN)
    return out


def _has_param_shape(leaves: Any, like_leaves: Any) -> bool:
    """Whether a leaf of `leaves` has the shape of an array of `like` (rank 1 or
    more): a moment, not a step count or a key."""
    shapes = {tuple(s) for s in (getattr(x, "shape", None) for x in like_leaves) if s}
    return any(tuple(getattr(x, "shape", ()) or ()) in shapes for x in leaves)


def _source(
    i: int,
    path: tuple,
    key: tuple,
    entries: list,
    by_path: dict,
    state: Optional[dict],
    leaves: Optional[list],
    what: str,
    treedef: Any,
) -> Source:
    """One leaf's `Source` (see `like_layout`)."""
    if state is not None:
        like_key = state.get(key)
        found = None if like_key is None else by_path.get(like_key)
        if found is None:
            return REPLICATED  # a count, a hyperparameter
        if not _same_shape(leaves, i, found[0]):
            if found[3]:  # stacked
                return REPLICATED
            # A statistic of another shape in a params-shaped subtree:
            # adafactor's factored moments, its parameter reduced over one dim,
            # as a reduction lays it out; else (placeholders) replicated.
            return _reduced(leaves[i], found, what)  # type: ignore[index]
    else:
        found = by_path.get(key)
    if found is None:
        return Source(
            None,
            missing=f"`like` has no leaf at {jax.tree_util.keystr(path)} (its "
            f"structure differs: {treedef})",
        )
    leaf, annotation, like_path, lead = found
    if lead and has_sharding(annotation):
        wrong = rank_mismatch(leaf, annotation, lead)
        if wrong:
            return Source(None, missing=f"`like` leaf of {wrong}", layout=True)
        where = "like" + jax.tree_util.keystr(like_path)
        return Source(stacked_spec(leaf, annotation, lead, where), leaf)
    return Source(_like_spec(leaf, annotation, like_path, what), leaf)


def _reduced(leaf: Any, found: tuple, what: str) -> Source:
    """The layout of a leaf whose shape is its parameter's without one dim: the
    parameter's spec without that dim's entry. Replicated when no dim, or several
    dims with different entries (equal sizes: which one is not known), fit."""
    like_leaf, annotation, like_path, _ = found
    shape, target = tuple(like_leaf.shape), tuple(getattr(leaf, "shape", ()))
    dims = [k for k in range(len(shape)) if shape[:k] + shape[k + 1 :] == target]
    if not dims:
        return REPLICATED
    spec = _like_spec(like_leaf, annotation, like_path, what)
    written = _spec.partitions_of(spec)  # JAX 0.10 refuses `tuple(spec)` here
    entries = written + (None,) * (len(shape) - len(written))
    candidates = {entries[:k] + entries[k + 1 :] for k in dims}
    if len(candidates) != 1:
        return REPLICATED
    return Source(_with_pending(candidates.pop(), spec), like_leaf)


def _with_pending(entries: tuple, spec: Any) -> PartitionSpec:
    """`PartitionSpec(*entries)` with `spec`'s unreduced / reduced axes."""
    unreduced, reduced = _spec.pending_of(spec)
    if not unreduced and not reduced:
        return PartitionSpec(*entries)
    return PartitionSpec(*entries, unreduced=unreduced, reduced=reduced)


def _same_shape(leaves: Optional[list], i: int, like_leaf: Any) -> bool:
    shape = getattr(like_leaf, "shape", None)
    return leaves is None or getattr(leaves[i], "shape", None) == shape


def stacked_spec(leaf: Any, annotation: Any, lead: tuple, where: str) -> PartitionSpec:
    """The spec of a leaf with `lead` stacked dims: those entries, then its
    annotation's for the remaining dims."""
    shape = tuple(getattr(leaf, "shape", ()))
    rest = shape[len(lead) :]
    if not has_sharding(annotation):
        return PartitionSpec(*lead, *([None] * len(rest)))
    spec = resolved_spec(leaf, annotation, lead, where)
    written = _spec.partitions_of(spec)
    entries = written + (None,) * (len(rest) - len(written))
    return _with_pending((*lead, *entries), spec)


def resolved_spec(leaf: Any, annotation: Any, lead: tuple, where: str) -> PartitionSpec:
    """A sharded annotation's spec for the leaf's dims after its `lead` stacked
    ones (their entries: the mesh axes they hold are taken), resolved as a
    check of that leaf would be (`_verdict.inputs.of_value`: its shape, or
    inside shard_map its rank, and its mesh)."""
    shape, mesh = of_value(leaf)
    n = len(lead)
    dims = shape[n:] if isinstance(shape, tuple) else shape - n
    return _bridge.spec_for(annotation, dims, mesh, where, lead)


def _like_spec(leaf: Any, annotation: Any, path: tuple, what: str) -> PartitionSpec:
    where = "like" + jax.tree_util.keystr(path)
    if has_sharding(annotation):
        return resolved_spec(leaf, annotation, (), where)
    if isinstance(leaf, Tracer):
        aval = jax.typeof(leaf)
        mesh = _mesh.of_aval(aval)
        if mesh is None:
            return PartitionSpec()
        unknown = [
            n
            for n, t, s in zip(mesh.axis_names, mesh.axis_types, mesh.axis_sizes)
            if t != AxisType.Explicit and s > 1
        ]
        if unknown:
            raise _UnknownLayout(
                f"{what}: {where} has no annotation, and inside this "
                f"trace its sharding over the non-Explicit mesh axes {unknown} is "
                "not known until XLA compiles. Annotate it (field annotations, "
                "`annotations=` or `rules=` on a check of `like` itself), or check "
                "against concrete arrays."
            )
        return aval.sharding.spec
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if sharding is None or len(sharding.device_set) == 1:
        return PartitionSpec()
    raise ShardingAnnotationError(
        f"{what}: {where} is sharded as {sharding}, which names no "
        "mesh axes to compare with. Place it with a NamedSharding."
    )


def like_specs(tree: Any, leaves: list, plan: Any, like: tuple, what: str) -> list:
    """Per leaf of `tree` (its `leaves` and walk `plan`) the spec `like`'s rule
    gives it; one `ShardingAnnotationError` naming every leaf it cannot place."""
    sources = like_layout(plan.paths, like, tree, leaves, what)
    wrong = [
        f"  tree{jax.tree_util.keystr(path)}: {s.missing}"
        for path, s in zip(plan.paths, sources)
        if s.spec is None
    ]
    if wrong:
        raise ShardingAnnotationError(
            f"{what}: {len(wrong)} leaf/leaves of the tree have no counterpart in "
            "`like` (give `like` the parameters whose structure the tree holds):\n"
            + "\n".join(wrong)
        )
    return [s.spec for s in sources]


def like_mesh(like: Any) -> Any:
    """The mesh of `like`'s first leaf placed with a `NamedSharding`, or `None`."""
    for leaf in jax.tree_util.tree_leaves(like):
        sharding = None if isinstance(leaf, Tracer) else getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None
