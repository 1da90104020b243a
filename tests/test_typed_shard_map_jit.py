"""`jts.jit` around a `typed_shard_map` function checks its boundary (issue 33,
item 5): shard_map lays each argument out by its in_spec before the body's
checks see it (on Auto axes without a word), so the function's own checker
never sees a committed argument placed otherwise. Explicit and Auto, through
a warm cache: a correct call, then a mis-sharded one, then the correct again.
"""

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, jaxtyped

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


X = Float[Array, "b d", P("data", None)]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("inner", ["plain", "jaxtyped"])
def test_a_misplaced_argument_is_caught_at_the_boundary(kind, inner):
    mesh = MESHES[kind]()

    def body(x: X, y: X) -> X:
        return x * y

    if inner == "jaxtyped":  # the body's own checks: inside, on local shards
        body = jaxtyped(typechecker=beartype)(body)
    step = jts.jit(jts.typed_shard_map(body, mesh=mesh))
    good = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))
    bad = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "model")))
    with jax.set_mesh(mesh):
        step(good, good)
        step(good, good)  # warm: JAX's cache
        with pytest.raises(jts.ShardingTypeCheckError) as info:
            step(good, bad)
        message = str(info.value)
        assert "float32[8,4@model]" in message and "P('data', None)" in message
        assert "`y`" in message or "y:" in message
        assert "x:" not in message and "`x`" not in message  # x is right
        if kind == "auto":  # the body's check inside does not report it twice
            assert message.startswith("1 sharding mismatch while compiling")
        else:  # before shard_map's own error, which names no argument
            assert "in_specs passed to shard_map" not in message
        assert float(step(good, good).sum()) == 32.0
