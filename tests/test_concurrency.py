"""Checks from many threads at once, each with its own mesh, give each its answer.

The annotations are shared module objects, so their verdict caches are shared
across threads; the context mesh (`jax.set_mesh`) is per thread. Every verdict a
thread sees is compared with one written out here by hand, and the tables are
themselves checked against JAX's `Sharding.is_equivalent_to`.
"""

import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import jax
import jaxtyping
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard.pytest_plugin import make_mesh

from .helpers import make_identity, no_transfers, place


ITERATIONS = 200
JIT_EVERY = 50
RAISES = "raises ShardingAnnotationError"

SPECS = {
    "row": P("data", None),
    "col": P(None, "model"),
    "model": P("model"),
    "flat": P(("data", "model")),
    "repl": P(),
    "x": P("x", None),
    "xyz": P(("x", "y"), "z"),
}
# Shared by all threads: one verdict cache per annotation, filled concurrently.
ANNOTATIONS = {name: Float[Array, "b e", spec] for name, spec in SPECS.items()}
ANNOTATIONS["row_inline"] = Float[Array, "b@data e"]
ANNOTATIONS["lead"] = Float[Array, "*lead e", P("data")]  # rank is part of its key
AXES = {
    "row": {"data"},
    "row_inline": {"data"},
    "lead": {"data"},
    "col": {"model"},
    "model": {"model"},
    "flat": {"data", "model"},
    "repl": set(),
    "x": {"x"},
    "xyz": {"x", "y", "z"},
}
ROWS = {"row", "row_inline", "lead"}
DATA_MODEL = {
    # placed as -> the annotations that match; all others that fit the mesh fail
    P("data", None): ROWS,
    P("model", None): {"model"},
    P(None, "model"): {"col"},
    P(("data", "model")): {"flat"},
    P(): {"repl"},
}
MESHES = {
    # name: (shape, axis names, axis type, placements table)
    "4x2 explicit": ((4, 2), ("data", "model"), "explicit", DATA_MODEL),
    "4x2 auto": ((4, 2), ("data", "model"), "auto", DATA_MODEL),
    "2x4 explicit": ((2, 4), ("data", "model"), "explicit", DATA_MODEL),
    "2x4 auto": ((2, 4), ("data", "model"), "auto", DATA_MODEL),
    "8 explicit": ((8,), ("data",), "explicit", {P("data"): ROWS, P(): {"repl"}}),
    "8x1 auto": (
        (8, 1),
        ("data", "model"),
        "auto",
        {
            # `model` has size 1: sharding over it is no sharding at all.
            P("data"): ROWS | {"flat"},
            P("data", "model"): ROWS | {"flat"},
            P(): {"repl", "model", "col"},
            P("model", None): {"repl", "model", "col"},
        },
    ),
    "2x2x2 explicit": (
        (2, 2, 2),
        ("x", "y", "z"),
        "explicit",
        {
            P("x", None): {"x"},
            P(("x", "y"), "z"): {"xyz"},
            P(): {"repl"},
            P("z", "x"): set(),
        },
    ),
    "8x1 explicit": (
        (8, 1),
        ("data", "model"),
        "explicit",
        {
            P("data", "model"): ROWS | {"flat"},
            P(None, "model"): {"repl", "model", "col"},
        },
    ),
}
# For each mesh, an annotation for `jit` and arrays placed to match and not.
JIT_CASES = {
    "8 explicit": ("row", P("data"), P()),
    "2x2x2 explicit": ("x", P("x", None), P("z", "x")),
    "8x1 auto": ("row", P("data"), P()),
    "8x1 explicit": ("row", P("data", "model"), P(None, "model")),
}
JIT_DEFAULT = ("row", P("data", None), P())


def _expected(mesh, placed_table, spec, name):
    if not AXES[name] <= set(mesh.axis_names):
        return False  # an axis the mesh lacks: no match (never an error)
    return name in placed_table[spec]


def _expected_unplaced(mesh, name):
    """A value on one device: only a spec that shards nothing describes it."""
    if mesh is None:
        return not AXES[name]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if not AXES[name] <= set(sizes):
        return False
    return all(sizes[a] == 1 for a in AXES[name])


def _verdict(x, name):
    try:
        return isinstance(x, ANNOTATIONS[name])
    except jts.ShardingAnnotationError:
        return RAISES


class _World:
    """Meshes, arrays, shared checked functions and the right answers."""

    def __init__(self):
        self.meshes = {}
        self.arrays = {}  # mesh name -> {placed as: array}
        self.cases = {}  # mesh name -> [(label, array, annotation name, expected)]
        self.unplaced = [
            (f"on device {d}", jax.device_put(np.ones((8, 4), np.float32), d))
            for d in jax.devices()[:2]
        ]
        for mesh_name, (shape, names, kind, table) in MESHES.items():
            mesh = make_mesh(shape, names, kind)
            self.meshes[mesh_name] = mesh
            cases = []
            self.arrays[mesh_name] = {}
            for spec in table:
                x = self.arrays[mesh_name][spec] = place(mesh, (8, 4), spec)
                for name in ANNOTATIONS:
                    expected = _expected(mesh, table, spec, name)
                    cases.append((f"{spec} as {name}", x, name, expected))
            self.cases[mesh_name] = cases
        self.checked = {
            name: make_identity("beartype", ann, ann)
            for name, ann in ANNOTATIONS.items()
        }
        self.jitted = {name: jax.jit(f) for name, f in self.checked.items()}
        self.auto_jitted = {name: jts.jit(f) for name, f in self.checked.items()}

    def check_all(self, mesh_name, offset=0):
        """Every case of one mesh, from `offset` on; returns the wrong verdicts."""
        wrong = []
        mesh = self.meshes[mesh_name]
        cases = self.cases[mesh_name]
        with jax.set_mesh(mesh):
            for label, x, name, expected in cases[offset:] + cases[:offset]:
                got = _verdict(x, name)
                if got != expected:
                    wrong.append(f"{mesh_name}: {label}: got {got}, want {expected}")
            for label, x in self.unplaced:
                for name in ANNOTATIONS:
                    expected = _expected_unplaced(mesh, name)
                    got = _verdict(x, name)
                    if got != expected:
                        wrong.append(
                            f"{mesh_name} context: {label} as {name}: got {got}, "
                            f"want {expected}"
                        )
        # The same values with no context mesh: the cached verdicts made under
        # this thread's (or another thread's) mesh must not leak here.
        for label, x in self.unplaced:
            for name in ANNOTATIONS:
                expected = _expected_unplaced(None, name)
                got = _verdict(x, name)
                if got != expected:
                    wrong.append(
                        f"no mesh: {label} as {name}: got {got}, want {expected}"
                    )
        return wrong

    def check_calls(self, mesh_name):
        """Checked functions: a match returns its argument, a mismatch raises."""
        wrong = []
        for label, x, name, expected in self.cases[mesh_name]:
            f = self.checked[name]
            try:
                ok = f(x) is x
            except jaxtyping.TypeCheckError:
                ok = False
            if ok != expected:
                wrong.append(f"{mesh_name}: call with {label}: passed={ok}")
        return wrong

    def check_jit(self, mesh_name):
        """One match and one mismatch inside `jit`, under the thread's mesh."""
        mesh = self.meshes[mesh_name]
        name, good_spec, bad_spec = JIT_CASES.get(mesh_name, JIT_DEFAULT)
        good = self.arrays[mesh_name][good_spec]
        bad = self.arrays[mesh_name][bad_spec]
        wrong = []
        auto = mesh.axis_types[0] == AxisType.Auto
        with jax.set_mesh(mesh):
            if auto:
                f = self.auto_jitted[name]
                out = f(good)
                if not out.sharding.is_equivalent_to(NamedSharding(mesh, good_spec), 2):
                    wrong.append(f"{mesh_name}: jit output {out.sharding}")
                try:
                    f(bad)
                    wrong.append(f"{mesh_name}: compile-time mismatch not raised")
                except jts.ShardingTypeCheckError as error:
                    # The failure raised must be this thread's, not another's.
                    if f"{dict(mesh.shape)}"[1:-1] not in str(error):
                        wrong.append(f"{mesh_name}: another mesh's error: {error}")
            else:
                f = self.jitted[name]
                out = f(good)
                if not out.sharding.is_equivalent_to(good.sharding, 2):
                    wrong.append(f"{mesh_name}: jit output {out.sharding}")
                try:
                    f.trace(bad)
                    wrong.append(f"{mesh_name}: trace-time mismatch not raised")
                except jaxtyping.TypeCheckError:
                    pass
        return wrong


@pytest.fixture(scope="module")
def world():
    return _World()


def _run_threads(world, iterations=ITERATIONS):
    names = list(MESHES)
    barrier = threading.Barrier(len(names))
    done = []

    def work(index):
        mesh_name = names[index]
        wrong = []
        try:
            barrier.wait(timeout=60)
            with no_transfers():
                for i in range(iterations):
                    wrong += world.check_all(mesh_name, offset=(i + index) % 7)
                    if i % 10 == index % 10:
                        wrong += world.check_calls(mesh_name)
                    if i % JIT_EVERY == 0:
                        wrong += world.check_jit(mesh_name)
                    if len(wrong) > 20:
                        break
                else:
                    done.append(mesh_name)
        except BaseException:
            wrong.append(f"{mesh_name}: {traceback.format_exc()}")
        return wrong

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that checks interleave
    try:
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            results = list(pool.map(work, range(len(names))))
    finally:
        sys.setswitchinterval(previous)
    wrong = [line for lines in results for line in lines]
    if not wrong:
        assert sorted(done) == sorted(names)  # every thread ran every iteration
    return wrong


def test_set_mesh_is_thread_local(world):
    # What the concurrent tests rely on: each thread sees only its own mesh.
    names = ["4x2 explicit", "8 explicit"]
    barrier = threading.Barrier(len(names) + 1)
    seen = {}

    def work(name):
        with jax.set_mesh(world.meshes[name]):
            barrier.wait(timeout=30)  # all meshes set at once
            seen[name] = jax.sharding.get_abstract_mesh()
            barrier.wait(timeout=30)

    with jax.set_mesh(world.meshes["2x2x2 explicit"]):
        threads = [threading.Thread(target=work, args=(n,)) for n in names]
        for t in threads:
            t.start()
        barrier.wait(timeout=30)
        mine = jax.sharding.get_abstract_mesh()
        barrier.wait(timeout=30)
        for t in threads:
            t.join()
    assert mine.axis_names == ("x", "y", "z")
    for name in names:
        assert seen[name] == world.meshes[name].abstract_mesh
    outside = []
    thread = threading.Thread(
        target=lambda: outside.append(jax.sharding.get_abstract_mesh())
    )
    with jax.set_mesh(world.meshes["4x2 explicit"]):
        thread.start()
        thread.join()
    assert outside[0].empty


def test_tables_agree_with_jax(world):
    # The hand-written answers are JAX's own equivalence, and test both ways.
    verdicts = set()
    for mesh_name, cases in world.cases.items():
        mesh = world.meshes[mesh_name]
        for label, x, name, expected in cases:
            verdicts.add(expected)
            if not AXES[name] <= set(mesh.axis_names):
                assert expected is False  # JAX cannot even build this sharding
                continue
            spec = SPECS.get(name, P("data"))
            want = NamedSharding(mesh, spec).is_equivalent_to(x.sharding, 2)
            assert want == expected, f"{mesh_name}: {label}"
    assert verdicts == {True, False}


def test_sequential_baseline(world):
    wrong = []
    with no_transfers():
        for mesh_name in MESHES:
            wrong += world.check_all(mesh_name)
            wrong += world.check_calls(mesh_name)
            wrong += world.check_jit(mesh_name)
    assert wrong == []


def test_concurrent_checks(world):
    wrong = _run_threads(world)
    assert wrong == [], "\n".join(wrong[:20])


def test_caches_correct_after_concurrent_use(world):
    _run_threads(world, iterations=20)
    cached = sum(len(ann._jts_verdicts) for ann in ANNOTATIONS.values())
    assert cached > 0  # the verdicts below come (at least partly) from the caches
    wrong = []
    with no_transfers():
        for mesh_name in reversed(MESHES):
            wrong += world.check_all(mesh_name)
            wrong += world.check_calls(mesh_name)
    # Fresh annotation objects, with empty caches, agree with the shared ones.
    for mesh_name, cases in world.cases.items():
        with jax.set_mesh(world.meshes[mesh_name]), no_transfers():
            for label, x, name, expected in cases:
                if name == "row_inline":
                    fresh = Float[Array, "b@data e"]
                elif name == "lead":
                    fresh = Float[Array, "*lead e", P("data")]
                else:
                    fresh = Float[Array, "b e", SPECS[name]]
                assert fresh is not ANNOTATIONS[name]
                try:
                    got = isinstance(x, fresh)
                except jts.ShardingAnnotationError:
                    got = RAISES
                if got != expected:
                    wrong.append(f"fresh {mesh_name}: {label}: {got}")
    assert wrong == [], "\n".join(wrong[:20])
