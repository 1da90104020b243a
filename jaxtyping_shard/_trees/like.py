"""`like=` over a tree that holds the parameters' structure inside it.

An optimiser state (optax's `ScaleByAdamState(count, mu, nu)`, the tuples of
`chain`, `MultiSteps`, `inject_hyperparams`) holds one or more subtrees with the
structure of the parameters, the moments, beside leaves of its own (step
counts, hyperparameters). `params_shaped` finds those subtrees, as
`optax.tree_map_params` does, by tree structure alone (optax is not imported),
and maps each of their leaves to the parameters' leaf at the same position.
"""

from typing import Any, Optional

import jax

from . import paths as _paths


def params_shaped(tree: Any, like_treedef: Any) -> Optional[dict]:
    """`{key ids of a leaf path of tree: index of like's leaf}` for every leaf of
    a subtree of `tree` whose structure is `like_treedef`; `None` when there is
    no such subtree, or when `like` is a single leaf (every array would match)."""
    if like_treedef.num_nodes == 1:
        return None

    def is_params(node: Any) -> bool:
        return jax.tree_util.tree_structure(node) == like_treedef

    matched: dict = {}
    for prefix, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_params)[
        0
    ]:
        if not is_params(node):
            continue
        for index, (path, _) in enumerate(
            jax.tree_util.tree_flatten_with_path(node)[0]
        ):
            matched[tuple(map(_paths.key_id, prefix + path))] = index
    return matched or None
