"""One process of `tests/test_persistent_cache.py`: compiles checked programs on an
Auto mesh with JAX's persistent compilation cache in a directory that every run
shares, and prints, per program, what happened and whether JAX took it from
that cache. Run as `python persistent_cache_worker.py CACHE_DIR RUN SEED`
(run 1 fills the cache, run 2 finds it filled). Not collected by pytest.
"""

import json
import logging
import random
import sys
import warnings
from typing import Any


CACHE_DIR, RUN, SEED = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

import jax  # noqa: E402  (after reading the arguments, before any JAX call)
import jax.numpy as jnp  # noqa: E402


jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import jaxtyping  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array  # noqa: E402

import jaxtyping_shard as jts  # noqa: E402
from jaxtyping_shard import Float  # noqa: E402


class _Hits(logging.Handler):
    """The modules JAX took from its persistent cache (its own debug log)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.modules: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Persistent compilation cache hit for"):
            self.modules.append(str(record.args[0]))  # type: ignore[index]


HITS = _Hits()
_compiler_log = logging.getLogger("jax._src.compiler")
_compiler_log.addHandler(HITS)
_compiler_log.setLevel(logging.DEBUG)
_compiler_log.propagate = False

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
PLACEMENTS = [P("data"), P("model"), P(None, "data"), P(), P(("data", "model"))]
SPECS = [*PLACEMENTS, P("data", "model"), P(None, "model")]


def _named(fn: Any, name: str) -> Any:
    fn.__name__ = fn.__qualname__ = name  # JAX names the module `jit_<name>`
    return fn


def checked(name: str, annotation: Any) -> Any:
    """`x -> sin(x) * 2`, the intermediate checked against `annotation`."""

    def f(x):
        y = jnp.sin(x)
        assert isinstance(y, annotation)
        return y * 2

    return _named(f, name)


def run(name: str, fn: Any, x: Any, mode: str = "check") -> dict:
    """Calls `jax.jit(fn)(x)` and says what happened (`outcome`: "pass", "error",
    "warned") and whether JAX took the program from its persistent cache."""
    seen = len(HITS.modules)
    jax_warned = False
    with warnings.catch_warnings(record=True) as caught, jts.set_mode(mode):
        warnings.simplefilter("always")
        try:
            with jax.set_mesh(MESH):
                jax.block_until_ready(jax.jit(fn)(x))
            outcome = "pass"
        except jaxtyping.TypeCheckError as error:
            assert isinstance(error, jts.ShardingTypeCheckError), error
            outcome = "error"
    for w in caught:
        if issubclass(w.category, jts.ShardingWarning):
            outcome = "warned"
        elif "ShardingMismatchNotCached" in str(w.message):
            jax_warned = True  # JAX's "Error writing persistent compilation cache"
        elif not issubclass(w.category, DeprecationWarning):
            # (Python 3.13 warns that this script, `__main__`, has no loader.)
            raise AssertionError(f"unexpected warning: {w.message}")
    hit = f"jit_{fn.__name__}" in HITS.modules[seen:]
    return {"outcome": outcome, "hit": hit, "not_cached_warning": jax_warned}


def place(spec: P) -> Any:
    return jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(MESH, spec))


def scenarios() -> dict:
    """Named programs, the same in both runs except `rules` (resolved otherwise)."""
    x = place(P("data"))
    good = Float[Array, "b e", P("data")]
    wrong = Float[Array, "b e", P("model")]
    out = {
        "unchecked": run(
            "unchecked", checked("unchecked", jaxtyping.Float[Array, "b e"]), x
        ),
        "checked": run("checked", checked("checked", good), x),
        "checked_warn_mode": run(
            "checked_warn_mode", checked("checked_warn_mode", good), x, "warn"
        ),
        "failing": run("failing", checked("failing", wrong), x),
        "failing_warn_mode": run(
            "failing_warn_mode", checked("failing_warn_mode", wrong), x, "warn"
        ),
    }
    # The same program, its logical annotation resolved by another table in run 2:
    # a check that fails there must not be skipped by run 1's cached pass.
    table = {"batch": "data" if RUN == 1 else "model", "e": None}
    with jts.axis_rules(table):
        logical = Float[Array, "batch e", jts.Logical]
        out["rules"] = run("rules", checked("rules", logical), x)

    def stacked(v):  # checks in two blocks: the scan's body, and the function
        def body(c, _):
            assert isinstance(c, good)
            return c * 2, None

        assert isinstance(v, good)
        return jax.lax.scan(body, v, None, length=2)[0]

    out["scan"] = run("scan", _named(stacked, "scan"), x)
    rows = Float[Array, "e", P()]
    batched = _named(jax.vmap(checked("vmapped", rows)), "vmapped")
    out["vmapped"] = run("vmapped", batched, x)
    return out


def differential(seed: int, count: int) -> list[dict]:
    """`count` random (placement, annotation) pairs of one program: each verdict
    against `Sharding.is_equivalent_to` (y = sin(x) keeps x's layout)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        placed = rng.choice(PLACEMENTS)
        spec = placed if rng.random() < 0.5 else rng.choice(SPECS)
        x = place(placed)
        result = run("diff", checked("diff", Float[Array, "b e", spec]), x)
        expected = NamedSharding(MESH, spec).is_equivalent_to(x.sharding, 2)
        assert result["outcome"] == ("pass" if expected else "error"), (placed, spec)
        cases.append({**result, "case": [str(placed), str(spec)]})
    return cases


if __name__ == "__main__":
    report = {
        "scenarios": scenarios(),
        # Run 2 replays run 1's pairs (seed 1), then pairs of its own.
        "replayed": differential(1, 8),
        "own": differential(SEED, 8) if RUN == 2 else [],
    }
    print("REPORT " + json.dumps(report))
