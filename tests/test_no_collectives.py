"""`jts.no_collectives(*axes)`: a block or function that must not communicate
over those mesh axes. Where JAX can tell (JAX >= 0.12, `no_collectives`, and
Explicit axes) it raises at the op at trace time with the library's message;
everywhere (older JAX, Auto axes, what XLA adds, the backward pass) the
report's `check()` fails naming the line. Both paths are taken by what the
running JAX has, never skipped.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import MESHES, P, place


# JAX >= 0.12: `jax.sharding.no_collectives` refuses at trace time.
TRACE_TIME = compat.no_collectives_state() is not None
IN = " in `dense`" if compat.hlo_stack_frames_usable() else ""  # JAX 0.8: no names
SOURCE = inspect.getsource(inspect.getmodule(inspect.currentframe()))  # type: ignore[arg-type]


def line_of(marker: str) -> int:
    (line,) = [
        i for i, t in enumerate(SOURCE.splitlines(), 1) if t.endswith(f"# {marker}")
    ]
    return line


def dense(x, w, out=None):
    return jnp.einsum("bi,io->bo", x, w, out_sharding=out)  # the op


def step(x, w, out=None):
    with jts.no_collectives("model"):  # the block
        y = dense(x, w, out)  # the site
    return y


def outside(x, w, out=None):
    return dense(x, w, out)


@jts.no_collectives("data")
def decorated(x, w):
    return jnp.einsum("bi,io->bo", x, w)  # decorated op


def contracting_over_model(mesh):
    """Arguments whose product contracts over `model`: an all-reduce."""
    return place(mesh, (8, 16), P("data", "model")), place(mesh, (16, 16), P("model"))


def out_of(mesh):
    explicit = mesh.axis_types[0] == jax.sharding.AxisType.Explicit
    return P("data", None) if explicit else None


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_communication_in_the_block_is_refused_with_its_line(kind):
    mesh = MESHES[kind]()
    x, w = contracting_over_model(mesh)
    out = out_of(mesh)
    with jax.set_mesh(mesh):
        if TRACE_TIME and kind == "explicit":
            # At the op, while JAX traces: the library's message, JAX's as cause.
            with pytest.raises(jts.ForbiddenCollectiveError) as caught:
                jts.collectives(functools.partial(step, out=out), x, w)
            text = str(caught.value)
            assert text.startswith(
                f"test_no_collectives.py:{line_of('the op')} in `dense`"
            )
            assert f"called from test_no_collectives.py:{line_of('the site')}" in text
            assert "over mesh axis `model`" in text
            block = f"test_no_collectives.py:{line_of('the block')}"
            assert f"no_collectives('model')` (at {block})" in text
            assert compat.is_forbidden_collective(caught.value.__cause__)
            return
        report = jts.collectives(functools.partial(step, out=out), x, w)
        # Elsewhere: the compiled program's all-reduce, from the block.
        (row,) = report.where(kind="all-reduce", axes="model").rows
        assert row.parts[0].no_collectives == frozenset({"model"})
        with pytest.raises(jts.CollectiveBudgetError) as caught:
            report.check()
    text = str(caught.value)
    assert (
        "1. no_collectives('model'): all-reduce over model, float32[2,16], at " in text
    )
    assert f"test_no_collectives.py:{line_of('the op')}{IN}: return" in text
    assert "2." not in text


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_other_axes_and_code_outside_the_block_pass(kind):
    mesh = MESHES[kind]()
    x, w = contracting_over_model(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(functools.partial(outside, out=out_of(mesh)), x, w)
        assert report.where(axes="model").count == 1  # it does communicate
        report.check()  # but outside any block
        # Forbidding `data` only: the reduction over `model` is allowed.
        allowed = jax.jit(
            lambda x, w: jts.no_collectives("data")(dense)(x, w, out_of(mesh))
        )
        report = jts.collectives(allowed, x, w)
        (row,) = report.rows
        assert row.parts[0].no_collectives == frozenset({"data"})  # seen, allowed
        report.check()


def test_the_backward_pass_is_held_too():
    # The forward runs on local shards; the weight's gradient sums over the
    # batch (split over `data`): an all-reduce made by the transpose, whose
    # name keeps the block's scope.
    mesh = MESHES["auto"]()
    x, w = (
        place(mesh, (8, 16), P("data", None)),
        place(mesh, (16, 16), P(None, "model")),
    )
    grad = jax.jit(jax.grad(lambda x, w: decorated(x, w).sum(), argnums=1))
    with jax.set_mesh(mesh):
        report = jts.collectives(grad, x, w)
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check()
    text = str(caught.value)
    assert "no_collectives('data'): all-reduce over data" in text
    assert f"test_no_collectives.py:{line_of('decorated op')}" in text


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_through_the_caches(kind):
    # Warm with a layout that communicates nothing, then the one that does.
    mesh = MESHES[kind]()
    out = out_of(mesh)
    jitted = jax.jit(step, static_argnums=2)
    quiet = place(mesh, (8, 16), P("data", None)), place(mesh, (16, 16), P(None, None))
    with jax.set_mesh(mesh):
        jitted(*quiet, out)
        jts.collectives(jitted, *quiet, out).check()
        loud = contracting_over_model(mesh)
        if TRACE_TIME and kind == "explicit":
            with pytest.raises(
                jts.ForbiddenCollectiveError, match="over mesh axis `model`"
            ):
                jitted(*loud, out)
            return
        jitted(*loud, out)  # runs: nothing here refuses it at trace time
        with pytest.raises(jts.CollectiveBudgetError, match="no_collectives"):
            jts.collectives(jitted, *loud, out).check()


def test_nested_blocks_forbid_the_union_and_bad_names_are_refused():
    mesh = MESHES["auto"]()
    x, w = contracting_over_model(mesh)

    def nested(x, w):
        with jts.no_collectives("data"), jts.no_collectives("model", "model"):
            return dense(x, w)

    with jax.set_mesh(mesh):
        report = jts.collectives(nested, x, w)
    (row,) = report.rows
    assert row.parts[0].no_collectives == frozenset({"data", "model"})
    with pytest.raises(jts.CollectiveBudgetError, match=r"no_collectives\('model'\)"):
        report.check()
    assert repr(jts.no_collectives("model", "model")) == "no_collectives('model')"
    with pytest.raises(TypeError, match="expected mesh axis names"):
        jts.no_collectives()
    with pytest.raises(ValueError, match="not a mesh axis name"):
        jts.no_collectives("data/model")
