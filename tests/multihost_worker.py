"""One process of the multi-process JAX job run by `test_multihost.py`.

Started by `tests.multihost.run_workers`: joins a job of 8 forced CPU devices
in all, as 2 processes x 4 or 4 x 2 (gloo collectives on loopback,
`join_job`), builds arrays that span the processes, and checks matching and
mis-sharded ones eagerly, inside `jit` with Explicit axes (trace time) and with
Auto axes (compile time).
Prints `WORKER <id> OK <number of checks>`, and exits 0, if all verdicts
were right. Not collected by pytest: it needs its own process.
"""

import sys

from tests.multihost import Checks, join_job


def main() -> int:
    process_id, _ = join_job()

    import jax
    import jax.numpy as jnp
    import jaxtyping
    import numpy as np
    from beartype import beartype
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jaxtyping import Array, jaxtyped

    import jaxtyping_shard as jts
    from jaxtyping_shard import Float

    assert jax.device_count() == 8, jax.devices()
    assert jax.local_device_count() == 8 // jax.process_count(), jax.local_devices()
    verdict = Checks(process_id)
    expect_raise = verdict.raises

    explicit = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit)
    )
    auto = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto)
    )
    whole = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)

    def global_array(mesh, spec, data=whole):
        """`data`, placed as `spec`, from the block this process holds."""
        sharding = NamedSharding(mesh, spec)
        local = sharding.addressable_devices_indices_map(data.shape).values()
        block = tuple(
            slice(
                min(index[d].start or 0 for index in local),
                max(n if index[d].stop is None else index[d].stop for index in local),
            )
            for d, n in enumerate(data.shape)
        )
        x = jax.make_array_from_process_local_data(sharding, data[block], data.shape)
        assert not x.is_fully_addressable, x.sharding
        assert x.sharding.is_equivalent_to(sharding, data.ndim), x.sharding
        return x

    # Made outside the transfer guards: only the checks must move no data.
    placed = {
        (kind, name): global_array(mesh, spec)
        for kind, mesh in (("explicit", explicit), ("auto", auto))
        for name, spec in (
            ("data", P("data", None)),
            ("model", P("model", None)),
            ("cols", P(None, "model")),
            ("both", P(("data", "model"))),
            ("replicated", P()),
        )
    }
    row = Float[Array, "b e", P("data", None)]
    row_inline = Float[Array, "b@data e"]
    col = Float[Array, "b e", P(None, "model")]
    flat = Float[Array, "b e", P(("data", "model"), None)]
    repl = Float[Array, "b e", P()]
    # The annotation each placement matches; every other one must fail.
    right = {
        "data": (row, row_inline),
        "cols": (col,),
        "both": (flat,),
        "replicated": (repl,),
        "model": (),
    }
    annotations = (row, row_inline, col, flat, repl)

    with jax.transfer_guard("disallow"):
        for (kind, name), x in placed.items():
            for ann in annotations:
                want = ann in right[name]
                verdict(
                    isinstance(x, ann) == want,
                    f"isinstance({kind} {name} {x.sharding.spec}, {ann.__name__})"
                    f" should be {want}",
                )

    @jaxtyped(typechecker=beartype)
    def identity(x: Float[Array, "b e", P("data", None)]) -> Float[Array, "b e"]:
        return x

    @jaxtyped(typechecker=beartype)
    def layer(
        x: Float[Array, "b e", P("data", None)],
        w: Float[Array, "e m", P(None, "model")],
    ) -> Float[Array, "b m", P("data", "model")]:
        return x @ w

    @jaxtyped(typechecker=beartype)
    def layer_wrong_out(
        x: Float[Array, "b e", P("data", None)],
        w: Float[Array, "e m", P(None, "model")],
    ) -> Float[Array, "b m", P("data", None)]:
        return x @ w  # sharded P("data", "model"), not as the return hint says

    w_cols = global_array(explicit, P(None, "model"), np.ones((4, 2), np.float32))

    with jax.transfer_guard("disallow"):
        x_ok, x_bad = placed["explicit", "data"], placed["explicit", "model"]
        verdict(identity(x_ok) is x_ok, "eager identity on a matching array")
        error = expect_raise(
            jaxtyping.TypeCheckError, identity, x_bad, what="eager mis-sharded array"
        )
        verdict("expected by the type hint" in error, f"message: {error}")
        for bad in ("cols", "both", "replicated"):
            expect_raise(
                jaxtyping.TypeCheckError,
                identity,
                placed["explicit", bad],
                what=f"eager {bad}",
            )
        y = layer(x_ok, w_cols)
        verdict(not y.is_fully_addressable, "layer output spans the processes")
        expect_raise(
            jaxtyping.TypeCheckError, layer, x_bad, w_cols, what="eager layer input"
        )
        error = expect_raise(
            jaxtyping.TypeCheckError,
            layer_wrong_out,
            x_ok,
            w_cols,
            what="eager layer return",
        )
        verdict("return value" in error, f"return value blamed: {error}")

    # Inside jit with Explicit axes: the mismatch is found at trace time.
    jitted = jax.jit(identity)
    with jax.set_mesh(explicit), jax.transfer_guard("disallow"):
        out = jitted(x_ok)
        verdict(out.sharding.is_equivalent_to(x_ok.sharding, 2), f"{out.sharding}")
        verdict(not out.is_fully_addressable, "jit output spans the processes")
        expect_raise(
            jaxtyping.TypeCheckError, jitted.trace, x_bad, what="trace-time mismatch"
        )
        expect_raise(
            jaxtyping.TypeCheckError, jitted, x_bad, what="trace-time mismatch (call)"
        )
        y = jax.jit(layer)(x_ok, w_cols)
        verdict(
            y.sharding.is_equivalent_to(NamedSharding(explicit, P("data", "model")), 2),
            f"jit layer output {y.sharding}",
        )
        error = expect_raise(
            jaxtyping.TypeCheckError,
            jax.jit(layer_wrong_out).trace,
            x_ok,
            w_cols,
            what="trace-time return mismatch",
        )
        verdict("return value" in error, f"return value blamed: {error}")

    # A real cross-process computation (an all-reduce through gloo), checked.
    @jax.jit
    @jaxtyped(typechecker=beartype)
    def total(x: Float[Array, "b e", P("data", None)]) -> Float[Array, ""]:
        return jnp.sum(x)

    with jax.transfer_guard("disallow"):
        s = total(x_ok)
        expect_raise(jaxtyping.TypeCheckError, total, x_bad, what="total mismatch")
    value = float(np.asarray(s.addressable_shards[0].data))
    verdict(value == float(whole.sum()), f"sum across processes: {value}")

    # Inside jit with Auto axes: checked when XLA compiles, raised by `jts.jit`.
    auto_identity = jts.jit(identity)
    xa_ok, xa_bad = placed["auto", "data"], placed["auto", "model"]
    with jax.set_mesh(auto), jax.transfer_guard("disallow"):
        out = auto_identity(xa_ok)
        verdict(out.sharding.is_equivalent_to(xa_ok.sharding, 2), f"{out.sharding}")
        error = expect_raise(
            jts.ShardingTypeCheckError,
            auto_identity,
            xa_bad,
            what="compile-time mismatch",
        )
        verdict("sharding mismatch while compiling `identity`" in error, error)
        for bad in ("cols", "both", "replicated"):
            expect_raise(
                jts.ShardingTypeCheckError,
                auto_identity,
                placed["auto", bad],
                what=f"compile-time {bad}",
            )

    return verdict.done()


if __name__ == "__main__":
    sys.exit(main())
