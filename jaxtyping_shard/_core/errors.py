"""The error and warning types of jaxtyping_shard.

Two families, as in jaxtyping: a bad annotation is an `AnnotationError` (not a
`TypeError`, so that no type checker swallows it); a value that fails its check is
a `TypeCheckError`.
"""

from jaxtyping import AnnotationError, TypeCheckError


class ShardingAnnotationError(AnnotationError):
    """A sharding annotation that cannot mean anything.

    Raised when the annotation is written (a third argument that is not a
    `PartitionSpec`, a mesh axis used twice, more spec entries than dims, ...), or
    when it meets a mesh that lacks one of the axes it names.
    """


class ShardingTypeCheckError(TypeCheckError):
    """A value whose sharding is not the one its annotation asks for.

    Raised by [`jaxtyping_shard.jaxtyped`][] for eager and trace-time mismatches
    (its message starts with the argument and the reason), and for the mismatches
    found when XLA compiles a function (meshes with `Auto` axes): all those of one
    compile in one error, raised from the call that compiled it (plain `jax.jit`
    included). Under `jaxtyping.jaxtyped` itself, eager and trace-time mismatches
    arrive as jaxtyping's own `TypeCheckError`.
    """


class PlacementError(ValueError):
    """Host-local data that cannot become the global array its annotation asks for.

    Raised by [`jaxtyping_shard.place`][] before anything is built (a local size
    that does not fit the annotation's sharding and the process count, a global
    size the mesh cannot split), and by its cross-process verification (processes
    with unequal shapes, replicas holding unequal data).
    """


class CollectiveBudgetError(AssertionError):
    """A compiled step whose collectives exceed its budget.

    Raised by [`jaxtyping_shard.Collectives.check`][]: a collective whose line is
    not in the saved baseline, or that moves more than the baseline says; total
    bytes over a bound; a collective a `forbid` selection selects. The message
    names the line of each (an `AssertionError`, so a test fails on it).
    """


class LayoutChangeError(AssertionError):
    """An intermediate of a step laid out otherwise than its baseline says.

    Raised by `jaxtyping_shard.Layouts.check`: each line whose operation's
    results are laid out anew (old and new layout in JAX's notation), each new
    intermediate, each gone; a report with nothing to hold (no intermediates,
    or layouts not read). An `AssertionError`, so a test fails on it.
    """


class ForbiddenCollectiveError(Exception):
    """An op that would communicate over a mesh axis that
    [`jaxtyping_shard.no_collectives`][] forbids there.

    Raised at trace time, at the op, where JAX can tell (JAX >= 0.12 and
    Explicit axes): the message names the op's line, its callers up to the
    `no_collectives` block, and the axis, and JAX's own error is its cause.
    Elsewhere the report of collectives finds the collective
    (`Collectives.check` raises a `CollectiveBudgetError` naming its line).
    """


class ShardingWarning(UserWarning):
    """A sharding mismatch reported in mode `"warn"`, instead of an error.

    Also: an annotation of the user's own that cannot be read (a name under
    `TYPE_CHECKING`), once per function or class. `warnings.filterwarnings(
    "error", category=jaxtyping_shard.ShardingWarning)` makes these errors.
    """


for _cls in (
    CollectiveBudgetError,
    LayoutChangeError,
    PlacementError,
    ShardingAnnotationError,
    ShardingTypeCheckError,
    ShardingWarning,
):
    _cls.__module__ = "jaxtyping_shard"
del _cls
