"""The annotations themselves: every jaxtyping dtype, jaxtyping's behaviour kept."""

import importlib
import pickle
import sys
import warnings

import jax
import jaxtyping
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PyTree

import jaxtyping_shard as jts
from jaxtyping_shard import Float

from .helpers import CHECK_ERRORS, place


JAXTYPING_DTYPES = sorted(
    name
    for name in dir(jaxtyping)
    if isinstance(getattr(jaxtyping, name), type)
    and issubclass(getattr(jaxtyping, name), jaxtyping.AbstractDtype)
    and name != "AbstractDtype"
)


def test_every_jaxtyping_dtype_is_provided():
    from jaxtyping_shard._annotation.dtypes import DTYPE_NAMES

    assert sorted(DTYPE_NAMES) == JAXTYPING_DTYPES
    for name in JAXTYPING_DTYPES:
        ours = getattr(jts, name)
        assert issubclass(ours, getattr(jaxtyping, name))
        assert ours.dtypes == getattr(jaxtyping, name).dtypes


@pytest.mark.parametrize("name", JAXTYPING_DTYPES)
def test_two_arguments_is_exactly_jaxtyping(name):
    ours = getattr(jts, name)[Array, "b e"]
    theirs = getattr(jaxtyping, name)[Array, "b e"]
    assert type(ours) is type(theirs)
    assert ours.dims == theirs.dims and ours.dtypes == theirs.dtypes
    assert not hasattr(ours, "_jts")


@pytest.mark.parametrize("name", JAXTYPING_DTYPES)
def test_three_arguments_subclass_jaxtyping(name):
    A = getattr(jts, name)[Array, "b e", P("data")]
    assert issubclass(A, jaxtyping.AbstractArray)
    assert A.dtypes == getattr(jaxtyping, name).dtypes


def test_dtype_classes_refuse_isinstance():
    with pytest.raises(jaxtyping.AnnotationError):
        isinstance(np.ones(3), Float)


def test_pickle_round_trip():
    # jax.Array itself cannot be pickled by reference (nor can jaxtyping's
    # Float[jax.Array, ...]); np.ndarray can, and so then can ours.
    A = Float[np.ndarray, "b e", P()]
    B = pickle.loads(pickle.dumps(A))
    assert B.__name__ == A.__name__
    assert B._jts == A._jts
    assert isinstance(np.ones((8, 4), np.float32), B)


def test_pytree_of_sharded_leaves(mesh_explicit):
    from beartype import beartype
    from jaxtyping import jaxtyped

    @jaxtyped(typechecker=beartype)
    def f(tree: PyTree[Float[Array, "b e", P("data", None)]]) -> int:
        return len(jax.tree_util.tree_leaves(tree))

    good = place(mesh_explicit, (8, 4), P("data"))
    bad = place(mesh_explicit, (8, 4), P("model"))
    assert f({"a": good, "b": [good, good]}) == 3
    with pytest.raises(CHECK_ERRORS):
        f({"a": good, "b": [good, bad]})


def _fresh_import(name, hook):
    sys.modules.pop(name, None)
    with hook:
        return importlib.import_module(name)


def test_jaxtyping_import_hook_with_beartype(mesh_explicit):
    module = _fresh_import(
        "tests.hooked.beartype_mod",
        jaxtyping.install_import_hook("tests.hooked.beartype_mod", "beartype.beartype"),
    )
    assert module.scale(place(mesh_explicit, (8, 4), P("data"))).shape == (8, 4)
    with pytest.raises(jaxtyping.TypeCheckError):
        module.scale(place(mesh_explicit, (8, 4), P("model")))


def test_typeguard_import_hook(mesh_explicit):
    import typeguard

    module = _fresh_import(
        "tests.hooked.typeguard_mod",
        typeguard.install_import_hook("tests.hooked.typeguard_mod"),
    )
    x = place(mesh_explicit, (8, 4), P("data"))
    assert module.add(x, x).shape == (8, 4)
    with pytest.raises(typeguard.TypeCheckError, match='argument "y"'):
        module.add(x, place(mesh_explicit, (8, 4), P("model")))
    with pytest.raises(typeguard.TypeCheckError):  # dims bind across arguments
        module.add(x, place(mesh_explicit, (4, 4), P("data")))


def test_typeguard_forms_that_do_not_check():
    # Documented in docs/getting-started.md: with typeguard 4, inline dim strings
    # cannot be parsed, and `jaxtyped(typechecker=typechecked)` checks nothing.
    from jaxtyping import jaxtyped
    from typeguard import InstrumentationWarning, typechecked

    with pytest.raises(SyntaxError):

        @typechecked
        def inline(x: Float[Array, "b e", P("data")]):
            return x

    A = Float[Array, "b e", P("data")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @jaxtyped(typechecker=typechecked)
        def silent(x: A):
            return x

    assert any(issubclass(w.category, InstrumentationWarning) for w in caught)
    assert silent(np.ones((8, 4), np.float32)) is not None  # unchecked


def test_static_checker_file_imports():
    # The pyright target also runs: the three-argument form works at run time.
    from .typecheck import check_static

    assert callable(check_static.layer)


def test_import_does_not_initialise_jax():
    # Users (and the pytest plugin) may still set the device count afterwards.
    import subprocess

    code = (
        "import jaxtyping_shard, jax; "
        "jax.config.update('jax_num_cpu_devices', 3); "
        "assert len(jax.devices('cpu')) == 3, jax.devices()"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("mode", ["check", "off"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_make_transparent_passes_every_value_of_that_annotation_only(
    request, kind, mode
):
    # jaxtyping's `jaxtyped` makes a generator's return hints transparent. The
    # hot path of an annotation reads no flag for it, so the flag must reach it
    # through the base class jaxtyping's part of the check runs on; the base is
    # jaxtyping's own class (shared with plain annotations), which must not change.
    mesh = request.getfixturevalue(f"mesh_{kind}")
    wrong = place(mesh, (8, 4), P("model", None))
    transparent = Float[Array, "b e", P("data", None)]
    other = Float[Array, "b e", P("data", None)]
    plain = jaxtyping.Float[Array, "b e"]
    with jts.set_mode(mode):
        assert isinstance(wrong, transparent) == (mode == "off")
        transparent.make_transparent()
        for value in (wrong, jax.numpy.zeros(3), np.zeros(3), "not an array"):
            assert isinstance(value, transparent)
        assert transparent is not other
        assert isinstance(wrong, other) == (mode == "off")
        assert not isinstance(np.zeros(3), other)
        assert not isinstance(np.zeros(3), plain)
