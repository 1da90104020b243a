"""Issue 35 item 4: the collectives of JAX's gradient accumulation.

The step as JAX's sharding-in-types documentation teaches it (the weights
`reduced` over `data`, each micro-batch's gradient `unreduced` over it through
the `lax.scan`, one reshard at the end) holds the budget "over `data`: one
all-reduce per step, outside the micro-batch loop", and its report names that
all-reduce as the deferred reduction. The same step with the tag dropped (each
micro-batch's gradient reduced inside the scan) fails by type at trace time and,
with the checks turned off, by the budget: each names its line.
"""

import importlib.util
import re

import jax
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import CHECK_ERRORS, MESHES, P, place


PROGRAM = """
import jax
import jax.numpy as jnp
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float

W = Float[Array, "e m {R:data}"]  # the weights, reduced over data
G = Float[Array, "e m {U:data}"]  # a gradient, unreduced over data
Micro = Float[Array, "k b e", P(None, "data", None)]
Summed = Float[Array, "e m", P(None, None)]
checked = jts.jaxtyped(typechecker=beartype)


def loss(w, xb):
    return jnp.sum(jnp.tanh(xb @ w))


@checked
def micro_grad(w: W, xb) -> G:
    return jax.grad(loss)(w, xb)


@checked
def add(acc: G, g: G) -> G:
    return acc + g


def step(w: W, xs: Micro) -> Summed:
    acc = jnp.zeros(w.shape, w.dtype, out_sharding=jts.out_sharding(G))

    def body(acc, xb):
        g = micro_grad(w, xb)
        return add(acc, g), None

    acc, _ = jax.lax.scan(body, acc, xs)
    return jts.reshard(acc, Summed)  # the one all-reduce of the step
"""

DROPPED = ("g = micro_grad(w, xb)", "g = jts.reshard(micro_grad(w, xb), Summed)")
ZEROS = "acc = jnp.zeros(w.shape, w.dtype, out_sharding=jts.out_sharding(G))"
# The whole tag dropped, so that JAX compiles it (it refuses to add a reduced
# gradient to an unreduced accumulator): a plain accumulator too.
DROPPED_ALL = (ZEROS, "acc = jnp.zeros(w.shape, w.dtype)")


def dropped(everywhere=False):
    source = PROGRAM.replace(*DROPPED)
    return source.replace(*DROPPED_ALL) if everywhere else source


# "Over `data`: one all-reduce per step, outside the micro-batch loop."
ONE_PER_STEP = {"at_most": [{"kind": "all-reduce", "axes": "data", "count": 1}]}
OUTSIDE_THE_LOOP = {
    "forbid": [{"kind": "all-reduce", "axes": "data", "loop": "inside"}]
}


def load(tmp_path, name, source):
    path = tmp_path / name / "accumulate.py"
    path.parent.mkdir()
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"accumulate_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module, path.read_text().splitlines()


def line_of(lines, text):
    (found,) = [i for i, line in enumerate(lines, 1) if line.strip() == text]
    return found


@pytest.fixture
def mesh():
    return MESHES["explicit"]()


def arguments(mesh, micro=4):
    w = place(mesh, (4, 2), P())
    xs = place(mesh, (micro, 8, 4), P(None, "data", None))
    with jax.set_mesh(mesh):
        return jts.reshard(w, P(None, None, reduced={"data"})), xs


def budget(report):
    report.check(**ONE_PER_STEP, **OUTSIDE_THE_LOOP)


@pytest.mark.parametrize("micro", [1, 4])
def test_jax_pattern_holds_the_budget_and_names_its_reduction(tmp_path, mesh, micro):
    module, lines = load(tmp_path, f"ok{micro}", PROGRAM)
    w, xs = arguments(mesh, micro)
    step = jts.jit(module.step)
    with jax.set_mesh(mesh):
        grads = step(w, xs)  # checked at trace time, every annotation
        report = jts.collectives(step, w, xs)
    assert grads.sharding.spec == P(None, None)
    budget(report)
    ((once,),) = [report.where(kind="all-reduce", axes="data").rows]
    assert (once.executions, once.in_loop, once.loops) == (1, False, ())
    assert once.deferred and once.role == "deferred reduction of unreduced over data"
    assert report.where(deferred=True).rows == (once,)
    assert report.where(kind="all-reduce", loop="outside").rows == (once,)
    assert not report.where(loop="inside").rows
    # The table says what it is.
    assert "[deferred reduction of unreduced over data]" in str(report)
    # XLA gives the reduction the line of the value it reduces: the scan's
    # result (the accumulator carried out of the loop).
    (source,) = once.sources
    assert source.file == "accumulate.py"
    assert source.line in (
        line_of(lines, "acc, _ = jax.lax.scan(body, acc, xs)"),
        line_of(
            lines, "return jts.reshard(acc, Summed)  # the one all-reduce of the step"
        ),
    )


@pytest.mark.parametrize("everywhere", [False, True])
def test_dropped_unreduced_fails_by_type_naming_the_line(tmp_path, mesh, everywhere):
    module, lines = load(tmp_path, f"typed{everywhere}", dropped(everywhere))
    w, xs = arguments(mesh)
    with jax.set_mesh(mesh), pytest.raises(CHECK_ERRORS) as info:
        jts.jit(module.step)(w, xs)
    text = str(info.value)
    head = text.split("is not")[0]
    culprit = "acc" if everywhere else "g"  # the first argument checked
    assert re.search(f'argument [`"]{culprit}[`"]', head), head  # named first
    assert "not unreduced over 'data' as `e m {U:data}`" in text
    # The call that passed it is the line that reduced it, inside the scan.
    line = line_of(lines, "return add(acc, g), None")
    assert any(
        str(entry.path).endswith("accumulate.py") and entry.lineno + 1 == line
        for entry in info.traceback
    ), [(str(e.path), e.lineno + 1) for e in info.traceback]


def test_dropped_unreduced_fails_the_budget_naming_the_line(tmp_path, mesh):
    module, lines = load(tmp_path, "budget", dropped(everywhere=True))
    w, xs = arguments(mesh)
    with jax.set_mesh(mesh), jts.set_mode("off"):  # the types unchecked
        step = jax.jit(module.step)
        report = jts.collectives(step, w, xs)
    in_loop = report.where(kind="all-reduce", axes="data", loop="inside")
    ((row,),) = [in_loop.rows]
    assert row.executions == 4 and not row.deferred and row.role == ""
    (loop,) = row.loops
    scan = line_of(lines, "acc, _ = jax.lax.scan(body, acc, xs)")
    assert loop.trips == 4
    if compat.hlo_stack_frames_usable():
        # JAX 0.8 gives a loop's instruction the frame of the op inside it.
        assert (loop.source.file, loop.source.line) == ("accumulate.py", scan)
    # Each bound fails, and names the line that reduces inside the loop.
    for bound in (ONE_PER_STEP, OUTSIDE_THE_LOOP):
        with pytest.raises(jts.CollectiveBudgetError) as info:
            report.check(**bound)
        text = str(info.value)
        assert "all-reduce over data" in text
        (source,) = row.sources
        assert f"accumulate.py:{source.line}" in text
        assert "[inside the loop at accumulate.py:" in text and "(4 trips)]" in text
    assert "at most 1 count per call" in _error(report, ONE_PER_STEP)
    assert "4 run" in _error(report, ONE_PER_STEP)
    assert "forbidden (kind='all-reduce', axes='data', loop='inside')" in _error(
        report, OUTSIDE_THE_LOOP
    )
    # The line is the reduction's own or the gradient's, inside the loop body.
    body = {line_of(lines, DROPPED[1]), line_of(lines, "return jax.grad(loss)(w, xb)")}
    body.add(line_of(lines, "return jnp.sum(jnp.tanh(xb @ w))"))
    assert row.sources[0].line in body, row.sources


def _error(report, bound) -> str:
    with pytest.raises(jts.CollectiveBudgetError) as info:
        report.check(**bound)
    return str(info.value)


def test_bounds_are_checked_when_written(mesh):
    w, xs = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(lambda w: w * 2, w)
    with pytest.raises(ValueError, match="where\\(loop=...\\): expected 'inside'"):
        report.where(loop="in")
    with pytest.raises(TypeError, match="with `count` and / or `bytes`"):
        report.check(at_most=[{"kind": "all-reduce"}])
    with pytest.raises(TypeError, match="deferred=...\\): expected True or False"):
        report.where(deferred="yes")
    report.check(at_most=[{"count": 0, "bytes": 0}])  # no collective at all


def test_a_bytes_bound(tmp_path, mesh):
    module, _ = load(tmp_path, "bytes", PROGRAM)
    w, xs = arguments(mesh)
    with jax.set_mesh(mesh):
        report = jts.collectives(jts.jit(module.step), w, xs)
    (row,) = report.where(kind="all-reduce", axes="data").rows
    report.check(at_most=[{"axes": "data", "bytes": row.bytes}])
    with pytest.raises(jts.CollectiveBudgetError, match="deferred reduction"):
        report.check(at_most=[{"axes": "data", "bytes": row.bytes - 1}])


def test_auto_mesh_reductions_are_not_called_deferred(mesh):
    # On `Auto` axes no value is unreduced: a reduction after a loop is XLA's.
    auto = MESHES["auto"]()
    xs = place(auto, (4, 8, 4), P(None, "data", None))
    w = place(auto, (4, 2), P())

    def step(w, xs):
        def body(acc, xb):
            return acc + jax.grad(lambda w: (xb @ w).sum())(w), None

        return jax.lax.scan(body, w * 0, xs)[0]

    with jax.set_mesh(auto):
        report = jts.collectives(step, w, xs)
    assert report.where(kind="all-reduce", axes="data").rows
    assert not report.where(deferred=True).rows
    assert all(not r.role for r in report.rows)
