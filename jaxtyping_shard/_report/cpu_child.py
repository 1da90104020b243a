"""The child process of `preflight(..., check_mesh="cpu")` (`cpu_mesh`):
`python -m jaxtyping_shard._report.cpu_child IN OUT`, started with
`JAX_PLATFORMS=cpu` and the forced device count set.

It reads the request `IN` (pickled by `cpu_mesh.compile_in_child`), builds the
real mesh, compiles the step there through preflight's own path (`preflight.
_annotated`, `_compile`: placed and checked as `jts.jit` would, under
`failures.collecting`, so every compile-time check that fails is collected) and
writes `("ok", cpu_mesh.Compiled)` or `("error", exception)` to `OUT`.
"""

import importlib
import importlib.util
import pickle
import resource
import sys
import time
import traceback
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding

from .._core import failures as _failures
from .._rules import scope as _scope
from .._rules.table import AxisRules
from . import collectives as _collectives, preflight as _preflight, temporaries
from .cpu_mesh import Compiled, Leaf


def main(request: str, answer: str) -> None:
    try:
        with open(request, "rb") as file:
            # Plain data first: the caller's path and script, then the rest, whose
            # unpickling imports the step's module.
            _prepare(**pickle.load(file))
            payload = pickle.load(file)
        result: Any = ("ok", _run(payload))
    except BaseException as error:  # every failure goes back to the caller
        result = ("error", _portable(error))
    with open(answer, "wb") as file:
        pickle.dump(result, file)


def _run(payload: dict) -> Any:
    jax.config.update("jax_enable_x64", payload["x64"])
    shape, names, types = payload["mesh"]
    mesh = jax.make_mesh(
        shape, names, axis_types=tuple(getattr(AxisType, t) for t in types)
    )

    def leaf(x: Any) -> Any:
        if not isinstance(x, Leaf):
            return x
        sharding = None if x.spec is None else NamedSharding(mesh, x.spec)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type
        )

    def built(tree: Any) -> Any:
        return jax.tree_util.tree_map(leaf, tree, is_leaf=lambda x: isinstance(x, Leaf))

    args, kwargs = built(payload["args"]), built(payload["kwargs"])
    fn = _step(payload["fn"])
    start = time.perf_counter()
    rules = _rules(payload["rules"])
    with _scope.given(rules), _failures.collecting() as found:
        jitted = _preflight._annotated(fn, args, kwargs)
        compiled = _preflight._compile(jitted, args, kwargs, mesh)
    seconds = time.perf_counter() - start
    outputs = [
        getattr(getattr(o, "sharding", None), "spec", None)
        for o in jax.tree_util.tree_leaves(compiled.out_info)
    ]
    rows = list(_collectives.collectives(compiled).rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return Compiled(
        list(found),
        outputs,
        temporaries.XlaMemory.of(compiled.memory_analysis()),
        temporaries.by_line(compiled),
        rows,
        seconds,
        peak,
    )


def _rules(state: Any) -> Any:
    """The caller's `AxisRules` from `cpu_mesh._rules_state`, as it was."""
    if state is None:
        return None
    pairs, linen, conflicts, gathered = state
    rules = object.__new__(AxisRules)
    object.__setattr__(rules, "linen", linen)
    object.__setattr__(rules, "conflicts", conflicts)
    rules._set_pairs(pairs, gathered)
    return rules


def _step(reference: Any) -> Any:
    kind, *rest = reference
    if kind == "pickled":
        return rest[0]
    module, qualname = rest
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _prepare(path: list, main: Any) -> None:
    """The caller's `sys.path`; its script as `__mp_main__` (and `__main__`)
    when the request names it, as `multiprocessing`'s spawn loads it."""
    sys.path[:0] = [p for p in path if p not in sys.path]
    if main is None:
        return
    spec = importlib.util.spec_from_file_location("__mp_main__", main)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)  # its `if __name__ == "__main__":` skipped
    sys.modules["__main__"] = module


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        text = "".join(traceback.format_exception(error)).strip()
        return RuntimeError(f"in the check_mesh='cpu' child process:\n{text}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
