"""Which compile's failures a thread raises when several threads compile one
function on different meshes at once.

JAX caches a lowering (a failed compile is not cached; its lowering is), so the
module a thread compiles may have been lowered by another thread: the thread
that lowered it is then no guide. The compile a thread raises must be on its own
context mesh (`jax.set_mesh`). Built from `Compile`s directly, so the order of
events that a race produces only now and then is made here every time.
"""

import threading
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtyping_shard._verdict import compiles
from jaxtyping_shard.pytest_plugin import make_mesh


class _Check:
    """A check that always fails, naming its mesh."""

    on_result = False
    mode = "check"

    def mismatch(self, sharding, batch_dims):
        return f"wrong on {dict(sharding.mesh.shape)}"


def _lowered_in_another_thread(name):
    out = []
    thread = threading.Thread(target=lambda: out.append(compiles.Compile(name)))
    thread.start()
    thread.join()
    return out[0]


def _compile_with(mesh, compile_):
    compile_.register(_Check(), ())
    compile_.report(0, NamedSharding(mesh, P()))


def _compile_under_way():
    compiles._compile_started.at = time.time()
    compiles._compile_started.name = "jit_f"
    compiles._compile_started.own = None  # no module lowered here (see below)


def test_a_compile_on_another_mesh_lowered_here_is_not_this_threads():
    mesh_a = make_mesh((4, 2), ("data", "model"), "auto")
    mesh_b = make_mesh((2, 4), ("data", "model"), "auto")
    _compile_under_way()
    # This thread once lowered the 4x2 module; another thread now compiles it
    # (reporting into it) while this thread compiles the 2x4 one, which another
    # thread lowered.
    theirs = compiles.Compile("jit_f")
    mine = _lowered_in_another_thread("jit_f")
    _compile_with(mesh_a, theirs)
    _compile_with(mesh_b, mine)
    try:
        with jax.set_mesh(mesh_b):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [mine]
        assert errors == ["wrong on {'data': 2, 'model': 4}"]
        with jax.set_mesh(mesh_a):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [theirs]
        # No context mesh: only the thread that lowered tells them apart.
        chosen, errors, _ = compiles._this_compile()
        assert chosen == [theirs]
    finally:
        with compiles._pending_lock:
            compiles._pending.pop(id(theirs), None)
            compiles._pending.pop(id(mine), None)
        compiles._compile_started.at = None


def test_no_compile_on_this_mesh_raises_only_its_own():
    # The context mesh matches none of the compiles with failures: this thread
    # raises what it lowered itself (its arrays on another mesh than the
    # context's), never another thread's compile on another mesh (the flake of
    # test_concurrent_checks: a 2x2x2 Explicit call, whose module has no
    # compile-time checks, raised the Auto threads' mismatches).
    mesh_a = make_mesh((4, 2), ("data", "model"), "auto")
    mesh_c = make_mesh((8,), ("data",), "auto")
    _compile_under_way()
    other = _lowered_in_another_thread("jit_f")
    _compile_with(mesh_a, other)
    here = compiles.Compile("jit_f")
    try:
        with jax.set_mesh(mesh_c):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [] and errors == []
        _compile_with(mesh_a, here)
        with jax.set_mesh(mesh_c):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [here]
        assert errors == ["wrong on {'data': 4, 'model': 2}"]
    finally:
        with compiles._pending_lock:
            compiles._pending.pop(id(other), None)
            compiles._pending.pop(id(here), None)
        compiles._compile_started.at = None


def test_a_clean_compile_lowered_here_takes_no_other_threads_failures():
    # This thread lowered the module it compiles and its checks found nothing;
    # another thread's failing compile of a function of the same name, on
    # another mesh, is pending: this thread raises nothing (the flake of
    # test_concurrent_checks, where a clean 2x4 call raised the 4x2 and 8x1
    # threads' mismatches).
    mesh_a = make_mesh((4, 2), ("data", "model"), "auto")
    mesh_b = make_mesh((2, 4), ("data", "model"), "auto")
    _compile_under_way()
    own = compiles.Compile("jit_f")
    compiles._compile_started.own = own
    other = _lowered_in_another_thread("jit_f")
    _compile_with(mesh_a, other)
    try:
        with jax.set_mesh(mesh_b):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [] and errors == []
        # Its own failure, found: raised, and only it.
        _compile_with(mesh_b, own)
        with jax.set_mesh(mesh_b):
            chosen, errors, _ = compiles._this_compile()
        assert chosen == [own]
        assert errors == ["wrong on {'data': 2, 'model': 4}"]
    finally:
        with compiles._pending_lock:
            compiles._pending.pop(id(other), None)
            compiles._pending.pop(id(own), None)
        compiles._compile_started.at = None
        compiles._compile_started.own = None
