"""Which mesh applies to a value: its own, the tracer's, or the context's."""

from typing import Any, Optional

import jax
from jax.sharding import AxisType


# `with mesh:` (deprecated from JAX 0.10.1 in favour of `jax.set_mesh`, still
# common in user code) sets only the private thread-resources environment, which
# no public API reads back, in every supported release.
try:
    from jax._src.mesh import thread_resources as _thread_resources
except ImportError:  # pragma: no cover - a JAX without it
    _thread_resources = None


def legacy_context_mesh() -> Optional[Any]:
    """The mesh of an enclosing `with mesh:` block, else `None`."""
    if _thread_resources is None:  # pragma: no cover - a JAX without it
        return None
    mesh = _thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def context_mesh() -> Optional[Any]:
    """The mesh set by `jax.set_mesh` (or the older `with mesh:`), else `None`.

    Returns an `AbstractMesh` or a `Mesh`; only axis names, sizes and types are used.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    return legacy_context_mesh()


def set_concrete_mesh() -> Optional[Any]:
    """The `Mesh` that `jax.set_mesh` set, with its devices, else `None`.

    Only outside `jit`: inside a trace JAX gives only the abstract mesh
    (`jax.sharding.get_mesh` raises there).
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:
        return None
    return None if mesh is None or mesh.empty else mesh


def concrete_context_mesh() -> Optional[Any]:
    """The context mesh, with its devices where they are known, else `None`.

    `jax.set_mesh` sets both a `Mesh` and its `AbstractMesh`; only the `Mesh` can
    compare a sharding that is not a `NamedSharding` (a `GSPMDSharding`, say) with
    a spec, since that needs the devices.
    """
    mesh = set_concrete_mesh()
    return mesh if mesh is not None else context_mesh()


def of_aval(aval: Any) -> Optional[Any]:
    """The mesh of a traced value: the one in its type, else the context's."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        mesh = context_mesh()
    return None if mesh is None or mesh.empty else mesh


def sizes(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def names_of_type(mesh: Any, kind: Any) -> frozenset[str]:
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == kind)


def format_mesh(mesh: Any) -> str:
    """`('data': 4, 'model': 2)`, with the axis types when they are not all Explicit."""
    if mesh is None or mesh.empty:
        return "(no mesh)"
    body = ", ".join(f"{n!r}: {s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes))
    kinds = {t for t in mesh.axis_types}
    if kinds == {AxisType.Explicit}:
        return f"({body})"
    if len(kinds) == 1:
        return f"({body}; {next(iter(kinds)).name} axes)"
    types = ", ".join(t.name for t in mesh.axis_types)
    return f"({body}; axis types {types})"
