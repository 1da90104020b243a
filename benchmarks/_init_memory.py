"""Memory of `sharded_init`: compiled temporaries per device / largest shard.

From `compiled.memory_analysis()` (deterministic; nothing runs). The init makes
two NxN float32 weights and a bias on the 4x2 mesh (N=4096: 64 MiB weights, an
8 MiB shard per device; `--smoke`: N=1024). Target: at most 2x the largest
shard, on Explicit and Auto meshes. Baselines, reported: `jax.jit` with
`out_shardings` alone.
"""

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxtyping_shard._drivers.init import sharded_init as _init


def _fn(n: int) -> Any:
    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w_in": jax.random.normal(k1, (n, n)),
            "w_out": jax.random.uniform(k2, (n, n)),
            "bias": jax.numpy.zeros(n),
        }

    return init


SPECS = {"w_in": P("data", "model"), "w_out": P("data", "model"), "bias": P("model")}


def _row(name: str, what: str, temp: int, shard: int, target: Any) -> dict:
    ratio = temp / shard
    verdict = "report" if target is None else ("PASS" if ratio <= target else "MISS")
    return dict(
        name=name,
        what=what,
        ratio=round(ratio, 4),
        target=target,
        target_text="report" if target is None else f"<= {target}x shard",
        verdict=verdict,
        candidate_text=f"{temp / 2**20:.2f} MiB",
        baseline_text=f"{shard / 2**20:.2f} MiB shard",
        temp_bytes=temp,
        shard_bytes=shard,
    )


def figures(smoke: bool) -> list[dict]:
    n = 1024 if smoke else 4096
    shard = n * n * 4 // 8
    key = jax.random.key(0)
    out = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
        request = _init.Request(_fn(n), (key,), mesh=mesh, annotations=SPECS)
        compiled, _ = _init.compile_init(request)
        temp = compiled.memory_analysis().temp_size_in_bytes
        out.append(
            _row(
                f"9. sharded_init temporaries, {kind.name}",
                f"{n}x{n} f32 weights, temp bytes/device over one shard",
                temp,
                shard,
                2.0,
            )
        )
        shardings = {k: NamedSharding(mesh, v) for k, v in SPECS.items()}
        with jax.set_mesh(mesh):
            plain = jax.jit(_fn(n), out_shardings=shardings).lower(key).compile()
        out.append(
            _row(
                f"9. jit(out_shardings) temps, {kind.name}",
                "the same init with jax.jit alone (baseline)",
                plain.memory_analysis().temp_size_in_bytes,
                shard,
                None,
            )
        )
    return out
