"""`jts.jit` of a `functools.partial`, a callable object or a bound method is
checked as the function underneath, without the arguments already bound."""

import dataclasses
import functools as ft

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES, place


Row = Float[Array, "b@data e"]


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return MESHES[request.param]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    w: Float[Array, "e m@model"]


def step(table: dict[str, Row], model: Dense, *, lr: float) -> dict[str, Row]:
    if lr <= 0:  # Python control flow: `lr` must stay the partial's constant
        raise ValueError("lr")
    return {"a": table["a"] * lr + model.w.sum()}


class Step:
    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __call__(self, table: dict[str, Row], model: Dense) -> dict[str, Row]:
        return step(table, model, lr=self.lr)

    def apply(self, table: dict[str, Row], model: Dense) -> dict[str, Row]:
        return step(table, model, lr=self.lr)


def rows(mesh, spec=P("data")):
    return {"a": place(mesh, (8, 4), spec)}


def dense(mesh, spec=P(None, "model")):
    return Dense(place(mesh, (4, 8), spec))


CALLABLES = {
    "partial": lambda: ft.partial(step, lr=0.5),
    "object": lambda: Step(0.5),
    "method": lambda: Step(0.5).apply,
    "partial of an object": lambda: ft.partial(Step(0.5)),
}


@pytest.mark.parametrize("kind", list(CALLABLES))
def test_checked_as_the_function_underneath(kind, mesh):
    f = jts.jit(CALLABLES[kind]())
    assert f(rows(mesh), dense(mesh))["a"].shape == (8, 4)
    # Warm, then new signatures with one argument mis-sharded each.
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        f(rows(mesh, P()), dense(mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w") as info:
        f(rows(mesh), dense(mesh, P()))
    name = "step" if kind == "partial" else "Step."
    assert f"jaxtyping_shard.jit({name}" in str(info.value) or name in str(info.value)
    with jts.set_mode("off"):
        f(rows(mesh, P()), dense(mesh))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        f(rows(mesh, P()), dense(mesh))


@pytest.mark.parametrize("kind", list(CALLABLES))
def test_derived_shardings_without_the_bound_arguments(kind, mesh):
    # No spurious "keyword-only arguments ['lr']": the partial binds `lr`, the
    # caller never passes it, and it stays a Python constant (see `step`).
    f = jts.jit(
        CALLABLES[kind](), in_shardings="annotations", out_shardings="annotations"
    )
    table = {"a": np.ones((8, 4), np.float32)}
    model = Dense(np.ones((4, 8), np.float32))
    with jax.set_mesh(mesh):
        out = f(table, model)
        ins = f.lower(table, model).compile().input_shardings[0]
    want = NamedSharding(mesh, P("data", None))
    assert out["a"].sharding.is_equivalent_to(want, 2)
    assert ins[0]["a"].is_equivalent_to(want, 2)
    assert ins[1].w.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    np.testing.assert_allclose(np.asarray(out["a"]), np.full((8, 4), 32.5))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"table\['a'\]"):
        f(rows(mesh, P()), dense(mesh))  # committed elsewhere: refused by path


def test_positionally_bound_arguments_leave_the_signature(mesh_explicit):
    f = jts.jit(ft.partial(step, rows(mesh_explicit), lr=1.0))
    f(dense(mesh_explicit))
    with pytest.raises(jts.ShardingTypeCheckError, match=r"model\.w") as info:
        f(dense(mesh_explicit, P()))
    assert "table" not in str(info.value)
    derived = jts.jit(ft.partial(step, lr=1.0), in_shardings="annotations")
    with jax.set_mesh(mesh_explicit):
        derived(rows(mesh_explicit), model=dense(mesh_explicit))  # bound by name
        with pytest.raises(TypeError, match=r"keyword-only arguments \['lr'\]"):
            # A bound keyword the caller passes again is the caller's: as any
            # keyword-only argument, it cannot take in_shardings.
            derived(rows(mesh_explicit), dense(mesh_explicit), lr=2.0)
