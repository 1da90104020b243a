"""`preflight(..., check_mesh="cpu")`: the step compiled on a real mesh of forced
CPU devices with the production mesh's shape, axis names and types, in a child
process, so that the caller's own devices (and JAX's backend, already started
with its device count) are untouched.

The child (`cpu_child`) is a fresh Python with `JAX_PLATFORMS=cpu` and
`--xla_force_host_platform_device_count=N`. It is sent, by `pickle`, the step by
reference (its module and qualified name: the module is imported there; a
script's functions are found by loading the script as `__mp_main__`, as
`multiprocessing`'s spawn does, so its top-level code must sit under
`if __name__ == "__main__":`), the arguments as shapes, dtypes and specs (no
data), the rules in force and `jax_enable_x64`. It compiles the step (never runs
it) and sends back what XLA decided: the compile-time checks that failed, the
results' layouts, `memory_analysis()`, the temporaries by line and the
collectives. The child is bounded by `TIMEOUT_S` and killed past it.

One process holds at most `MAX_DEVICES` forced CPU devices for a compile (at
2,049, XLA's CPU client fails "Multiprocess computations aren't implemented on
the CPU backend"). A larger mesh is *folded* (`method` "folded"): its largest
axis divided by its smallest factor, again until the mesh fits, and the step
compiled there with the same global shapes. Each folded axis divides the real
one, so every dim the real mesh divides is divided there too and each check
runs on the same specs; a device holds shards larger by the fold along that
axis, so the temporaries are an estimate from above (the arguments and results
are counted exactly, on the real mesh, by the trace) and the collectives'
groups over it are smaller by the fold. (Several processes on loopback were the
other way: each would compile the whole program, on 2 cores at twice the time.)
"""

import dataclasses
import math
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._core import mesh as _mesh
from .._rules import scope as _scope
from .abstract_args import abstract, is_array
from .collectives import Collectives


MAX_DEVICES = 2048  # forced CPU devices one process compiles on (2,049 fails)
TIMEOUT_S = 900.0  # seconds the child may take, then it is killed
CHILD_ENV = "JAXTYPING_SHARD_CPU_MESH_CHILD"


class Leaf(NamedTuple):
    """An array argument as sent to the child: no data."""

    shape: tuple
    dtype: Any
    spec: Any  # a PartitionSpec, or None: placed as annotated
    weak_type: bool


@dataclasses.dataclass
class Compiled:
    """What the child's compile found (plain data, pickled back)."""

    findings: list  # `failures.Finding`s of the compile-time checks
    outputs: list  # per result leaf: its PartitionSpec (None: not a NamedSharding)
    memory: Any  # `temporaries.XlaMemory`
    temporaries: Optional[list]  # `temporaries.Temporary`, largest first; or None
    collectives: list  # `collectives.Collective` rows, at the real group sizes
    seconds: float  # the child's compile, its trace included
    peak_rss_bytes: int  # the child's peak resident memory


def folded(mesh: Any) -> tuple:
    """The axis sizes the step is compiled on for `mesh`: its own up to
    `MAX_DEVICES` devices; beyond, its largest axis divided by its smallest
    factor, again until they fit."""
    sizes = list(mesh.axis_sizes)
    while math.prod(sizes) > MAX_DEVICES:
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i] //= next(f for f in range(2, sizes[i] + 1) if sizes[i] % f == 0)
    return tuple(sizes)


def method(mesh: Any) -> str:
    """`report.check_mesh_method`: "one process" (the mesh itself) or "folded"."""
    return "one process" if folded(mesh) == tuple(mesh.axis_sizes) else "folded"


def describe(mesh: Any) -> str:
    """How `checks.compiled_on` names the compile."""
    sizes = folded(mesh)
    if sizes == tuple(mesh.axis_sizes):
        return (
            f"{_mesh.format_mesh(mesh)}: {mesh.size:,} forced CPU devices in one "
            "child process (check_mesh='cpu')"
        )
    compiled = AbstractMesh(sizes, mesh.axis_names, axis_types=mesh.axis_types)
    folds = ", ".join(
        f"'{name}' {real // size}x"
        for name, real, size in zip(mesh.axis_names, mesh.axis_sizes, sizes)
        if real != size
    )
    return (
        f"{_mesh.format_mesh(compiled)}: {compiled.size:,} forced CPU devices in "
        f"one child process, the mesh {_mesh.format_mesh(mesh)} folded ({folds} "
        f"smaller; one process holds at most {MAX_DEVICES:,}): each device's "
        "shards along a folded axis are larger by its fold, so the temporaries "
        "are an estimate from above and the collectives' groups over it smaller "
        "(check_mesh='cpu', method 'folded')"
    )


def check_mesh_of(check_mesh: Any, mesh: Any) -> Any:
    """preflight's `check_mesh=`: a concrete `Mesh` like `mesh`, `"cpu"`, or
    (omitted) `mesh` itself if concrete, else None."""
    if check_mesh is None:
        return mesh if isinstance(mesh, Mesh) else None
    if isinstance(check_mesh, str) and check_mesh == "cpu":
        return check_mesh
    if not isinstance(check_mesh, Mesh):
        raise ValueError(
            "preflight: check_mesh must be a concrete `jax.sharding.Mesh` (the "
            "step is compiled on it), e.g. `jax.make_mesh((4, 2), names, "
            'axis_types=...)` over forced CPU devices, or "cpu" (the production '
            f"mesh itself, of forced CPU devices in a child process); not "
            f"{check_mesh!r}."
        )
    if tuple(check_mesh.axis_names) != tuple(mesh.axis_names) or tuple(
        check_mesh.axis_types
    ) != tuple(mesh.axis_types):
        raise ValueError(
            f"preflight: check_mesh {_mesh.format_mesh(check_mesh)} must have the "
            f"axis names and types of mesh {_mesh.format_mesh(mesh)}, in order."
        )
    return check_mesh


def compile_in_child(fn: Any, args: tuple, kwargs: dict, mesh: Any) -> Compiled:
    """Compiles `fn(*args, **kwargs)` on a real CPU mesh like `mesh` (folded
    beyond `MAX_DEVICES`), in a child."""
    if os.environ.get(CHILD_ENV):
        raise RuntimeError(
            "preflight(check_mesh='cpu') was called inside its own child process: "
            "the child imported a script whose top-level code calls preflight. "
            "Put that code under `if __name__ == '__main__':`."
        )
    payload = {
        "fn": _reference(fn),
        "args": _leaves(abstract(args, mesh)),
        "kwargs": _leaves(abstract(kwargs, mesh)),
        "mesh": (
            folded(mesh),
            tuple(mesh.axis_names),
            tuple(t.name for t in mesh.axis_types),
        ),
        "rules": _rules_state(_scope.current()),
        "x64": bool(jax.config.read("jax_enable_x64")),
    }
    with tempfile.TemporaryDirectory(prefix="jts-cpu-mesh-") as folder:
        sent, back = os.path.join(folder, "in.pkl"), os.path.join(folder, "out.pkl")
        try:
            body = pickle.dumps(payload)
            main = _main_file() if b"__main__" in body else None
            with open(sent, "wb") as file:
                pickle.dump({"path": list(sys.path), "main": main}, file)
                file.write(body)
        except Exception as error:
            raise ValueError(
                "preflight: check_mesh='cpu' sends the step's arguments to a child "
                f"process by pickle, and they do not pickle: {error}. Pass "
                "arguments whose containers are importable classes."
            ) from error
        command = [sys.executable, "-m", "jaxtyping_shard._report.cpu_child"]
        try:
            done = subprocess.run(
                [*command, sent, back],
                env=_environment(math.prod(folded(mesh))),
                capture_output=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as error:
            raise TimeoutError(
                f"preflight: the compile on {describe(mesh)} did not finish within "
                f"{TIMEOUT_S:g} s, and the child was killed. Raise "
                "`jaxtyping_shard._report.cpu_mesh.TIMEOUT_S`, or preflight on a "
                "smaller mesh."
            ) from error
        if done.returncode != 0 or not os.path.exists(back):
            tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-12:]
            raise RuntimeError(
                f"preflight: the compile on {describe(mesh)} failed (exit "
                f"{done.returncode}):\n" + "\n".join(tail)
            )
        with open(back, "rb") as file:
            status, value = pickle.load(file)
    if status == "error":  # raised in the child: re-raised here, same type
        raise value
    return value


def _reference(fn: Any) -> Any:
    """`fn` itself if it pickles (by reference: a module-level function), else
    `("ref", module, qualname)` of a module-level `jax.jit` / `jts.jit` object."""
    try:
        pickle.dumps(fn)
        return ("pickled", fn)
    except Exception:
        pass
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    found: Any = sys.modules.get(module) if isinstance(module, str) else None
    for part in qualname.split(".") if isinstance(qualname, str) else [None]:
        found = getattr(found, part, None) if part else None
    if found is not fn:
        raise ValueError(
            f"preflight: check_mesh='cpu' compiles in a child process, which "
            f"imports the step by its module and name; {fn!r} is not found as "
            f"`{module}.{qualname}`. Define the step at the top level of an "
            "importable module (or of the script, its code under `if __name__ == "
            "'__main__':`), not inside a function."
        )
    return ("ref", module, qualname)


def _rules_state(rules: Any) -> Any:
    """The rules in force as plain data (an `AxisRules` refuses to be unpickled
    into: it is immutable); `cpu_child._rules` rebuilds it."""
    if rules is None:
        return None
    return (rules.pairs, rules.linen, rules.conflicts, rules.gathered)


def _main_file() -> Optional[str]:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) else None


def _leaves(tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if not is_array(x):
            return x
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        weak = bool(getattr(x, "weak_type", False))
        return Leaf(tuple(x.shape), np.dtype(x.dtype), spec, weak)

    return jax.tree_util.tree_map(leaf, tree)


def _environment(devices: int) -> dict:
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={devices}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    # The caller's path, so that the child imports this very package (and the
    # step's module) from where the caller did.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env[CHILD_ENV] = "1"
    return env


def add_findings(found: Any, child: Compiled) -> None:
    """The child's findings not already found by the trace on the AbstractMesh
    (the child traces the step again: its trace-time checks find the same)."""
    for finding in child.findings:
        if finding not in found.seen:
            found.seen.add(finding)
            found.append(finding)


def outputs(traced: Any, child: Compiled, mesh: Any) -> Any:
    """The step's results as XLA laid them out on the real mesh, on `mesh`."""
    leaves, treedef = jax.tree_util.tree_flatten(traced)
    if len(leaves) != len(child.outputs):
        return traced
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(
                leaf.shape,
                leaf.dtype,
                sharding=None if spec is None else NamedSharding(mesh, spec),
            )
            for leaf, spec in zip(leaves, child.outputs)
        ],
    )


def collectives_of(child: Compiled, name: str, mesh: Any) -> Any:
    return Collectives(child.collectives, name, mesh)
