"""typeguard's message with the sharding reason in it.

typeguard checks a class annotation with `isinstance` and says only "is not an
instance of ...". Its public extension point, `typeguard.checker_lookup_functions`,
lets jaxtyping_shard check its own annotations and say why. It is registered when
jaxtyping_shard is imported or an annotation is made while typeguard is imported
(typeguard is never imported here: it stays optional).
"""

import sys
from typing import Any, Optional


_registered = False


def register() -> None:
    """Puts `lookup` first in typeguard's checker lookups, once typeguard is here."""
    global _registered
    typeguard = sys.modules.get("typeguard")
    if typeguard is None:
        return
    lookups = getattr(typeguard, "checker_lookup_functions", None)
    if lookups is None:  # not typeguard 4
        _registered = True
        return
    if lookup not in lookups:
        lookups.insert(0, lookup)
    _registered = True


def register_once() -> None:
    if not _registered:
        register()


def lookup(origin_type: Any, args: tuple, extras: tuple) -> Optional[Any]:
    """typeguard's lookup protocol: our checker for our annotations, else None."""
    if isinstance(origin_type, type) and hasattr(origin_type, "_jts"):
        return _check
    return None


def _check(value: Any, origin_type: Any, args: tuple, memo: Any) -> None:
    if isinstance(value, origin_type):  # the fast path, cached verdicts included
        return
    # typeguard is an optional dependency: imported only once it is in use.
    from typeguard import TypeCheckError

    name = f"{origin_type.__module__}.{origin_type.__qualname__}"
    reason = origin_type.__instancecheck_str__(value)
    if reason:
        raise TypeCheckError(f"is not an instance of {name}, as {reason}")
    raise TypeCheckError(f"is not an instance of {name}")
