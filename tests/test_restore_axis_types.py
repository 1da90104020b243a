"""A restore that would break the first jit fails the check (issue 33, item 3).

An array restored onto a mesh of the same devices with other axis types (a
target built on an Auto mesh, `jax.make_mesh`'s default before JAX 0.9) has the
layout asked for, so `is_equivalent_to` accepts it; under `jax.set_mesh` of
the Explicit mesh the first `jit` then raises (Orbax's issue 2408). Where the
context mesh, or the mesh of a concrete sharding asked for, makes axis types
matter, the check compares them and names the leaf, both axis types and the
fix. Real Orbax, both mesh kinds, and the ordinary cases that must pass.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import MESHES


ocp = pytest.importorskip("orbax.checkpoint")

OTHER = {"explicit": "auto", "auto": "explicit"}
TYPES = {"explicit": "(Explicit, Explicit)", "auto": "(Auto, Auto)"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Float[Array, "e m@model"]
    b: Float[Array, "m"]  # noqa: F821 - dims only: checked, no sharding


def init():
    return Params(jnp.arange(32.0).reshape(4, 8), jnp.zeros(8))


def loss(params):
    return jnp.sum(params.w) + jnp.sum(params.b)


def target(kind):
    return jts.abstract(init, mesh=MESHES[kind]())


def restore(path, kind):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target(kind))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "params"
    params = jts.sharded_init(init, mesh=MESHES["explicit"]())
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
        checkpointer.wait_until_finished()
    return path


def _named(call):
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_restored_on_other_axis_types_fails_under_the_context_mesh(saved, kind):
    # Restored onto the other kind's target, used under this kind's mesh.
    mesh = MESHES[kind]()
    restored = restore(saved, OTHER[kind])
    # Warm the verdicts outside any context mesh: no jit breaks there.
    assert jts.check_tree(restored, name="params") is restored
    jax.jit(loss)(restored)
    with jax.set_mesh(mesh):
        # Through the warm caches: the context mesh is compared all the same.
        text = _named(lambda: jts.check_tree(restored, name="params"))
        assert "2 of 2 checked leaves do not match" in text.splitlines()[0]
        for leaf in ("params.w", "params.b"):
            assert f"\n  {leaf}: this array is on a mesh with axis types " in text
        assert f"{TYPES[OTHER[kind]]}, not {TYPES[kind]} as the context mesh" in text
        assert "the shardings of `jts.abstract(..., mesh=mesh)`" in text
        # What the check stands for: the first jit under this mesh raises.
        with pytest.raises(ValueError, match="context mesh"):
            jax.jit(loss)(restored)
        # The jts.jit boundary names the leaf at trace time, before JAX's error.
        text = _named(lambda: jts.jit(loss)(restored))
        # (`b` declares no sharding: the boundary checks only sharded leaves.)
        assert "arguments: 1 of 1 checked" in text
        assert "\n  params.w: this traced" in text
        # The fix the message gives: onto `jts.abstract`'s shardings, then both pass.
        fixed = jax.device_put(
            restored, jax.tree.map(lambda s: s.sharding, target(kind))
        )
        jts.check_tree(fixed)
        jax.jit(loss)(fixed)
        with jts.set_mode("warn"):
            with pytest.warns(jts.ShardingWarning) as record:
                jts.check_tree(restored, name="params")
        said = sorted(str(w.message).split(":")[0] for w in record)
        assert said == ["params.b", "params.w"]
        with jts.set_mode("off"):
            jts.check_tree(restored)


def test_an_explicit_target_asks_for_its_axis_types_without_a_context(saved):
    # `like=` the Explicit target, or its shardings as annotations: its axis
    # types are part of what it asks for, context mesh or none.
    restored = restore(saved, "auto")
    explicit = target("explicit")
    text = _named(lambda: jts.check_tree(restored, like=explicit, name="params"))
    assert "params.w: this array is on a mesh with axis types (Auto, Auto)" in text
    assert "not (Explicit, Explicit) as the mesh of NamedSharding" in text
    shardings = jax.tree.map(lambda s: s.sharding, explicit)
    assert "tree.w: this array is on" in _named(
        lambda: jts.check_tree(restored, shardings)
    )
    # The abstract target on Auto axes under the Explicit mesh: restoring onto
    # it is what breaks the jit, and the check of the target says so first.
    with jax.set_mesh(MESHES["explicit"]()):
        assert "tree.w: this array is on a mesh" in _named(
            lambda: jts.check_tree(target("auto"))
        )


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_no_false_alarm_where_the_axis_types_agree_or_do_not_matter(saved, kind):
    mesh = MESHES[kind]()
    restored = restore(saved, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.set_mesh(mesh):  # restored onto this mesh, used under it
            jts.check_tree(restored)
            jts.check_tree(restored, like=target(kind))
            jts.jit(loss)(restored)
        # No context mesh, an all-Auto target: XLA decides, types ask nothing.
        jts.check_tree(restored, like=target("auto"))
        if kind == "auto":  # a leaf that declares nothing is not compared
            with jax.set_mesh(MESHES["explicit"]()):
                jts.check_tree({"w": restored.w}, may_check_nothing=True)
