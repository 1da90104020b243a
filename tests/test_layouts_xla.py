"""`jts.layouts` on Auto meshes, what XLA wrote read without guessing: its
shardings (tiles, and from JAX 0.12 its named form) mapped to the mesh's axes
or left unread and said so; the reading adds no op to the program; JAX's
persistent cache never yields a silent report.
"""

import os
import re
import subprocess
import sys

import jax
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat
from jaxtyping_shard._report import groups, propagated
from jaxtyping_shard._report.layouts import Layout, Layouts

from .helpers import MESHES
from .test_layouts import inputs, load, program


def test_unread_layouts_fail_unless_allowed(tmp_path):
    mesh = MESHES["auto"]()
    row = Layout("add", "float32[8]", "float32[8]?{maximal device=0}", None, "", False)
    report = Layouts([row], "step", mesh, "xla")
    assert report.unread == (row,)
    report.save(tmp_path / "b.json")
    with pytest.raises(jts.LayoutChangeError, match=r"1 layout\(s\) XLA wrote"):
        report.check(tmp_path / "b.json")
    report.check(tmp_path / "b.json", allow_unread=True)


@pytest.mark.parametrize(
    "sharding, rank, expected",
    [
        ("{devices=[4,1,2]<=[8] last_tile_dim_replicate}", 2, (("data",), ())),
        ("{devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}", 2, ((), ("model",))),
        ("{devices=[4,2]<=[8]}", 2, (("data",), ("model",))),
        ("{devices=[2,4]<=[4,2]T(1,0)}", 2, (("model",), ("data",))),
        ("{devices=[8,1]<=[8]}", 2, (("data", "model"), ())),
        ("{devices=[8]<=[4,2]T(1,0)}", 1, (("model", "data"),)),
        ("{devices=[4,2]0,1,2,3,4,5,6,7}", 2, (("data",), ("model",))),
        ("{replicated}", 2, ((), ())),
        ("{manual}", 2, propagated.MANUAL),
        ("{devices=[2,1,4]<=[8] last_tile_dims={manual}}", 2, propagated.MANUAL),
        # Half of `data` (a tile per pair of its devices): no mesh axis says it.
        ("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", 2, None),
        ("{maximal device=0}", 2, None),
        ("{devices=[4,2]<=[8]}", 3, None),  # the wrong rank: never guessed
    ],
)
def test_xla_shardings_read_as_mesh_axes(sharding, rank, expected):
    mesh = MESHES["auto"]()

    assert (
        propagated.entries(sharding, rank, groups.coordinates(mesh), mesh) == expected
    )


def test_reading_auto_layouts_adds_no_op_to_the_program(tmp_path):
    module = load(tmp_path, "v1", program("auto"))
    mesh = MESHES["auto"]()
    with jax.set_mesh(mesh):
        lowered = jax.jit(module.step).lower(*inputs(mesh))
    dumped, text, proto = propagated.compile_dumped(lowered)
    assert text is not None and proto is not None and "sharding={" in text
    assert dumped.as_text() == lowered.compile().as_text()


@pytest.mark.parametrize(
    "sharding, rank, expected",
    [
        (
            "{mesh['data'=4,'model'=2], [{'data', 'model'}, {}]}",
            2,
            (("data", "model"), ()),
        ),
        (
            "{mesh['data'=4,'model'=2], [{}, {'model', 'data'}]}",
            2,
            ((), ("model", "data")),
        ),
        ("{mesh['data'=4,'model'=2], [{'data'}]}", 1, (("data",),)),
        ("{mesh[], replicated}", 2, ((), ())),
        ("{mesh['data'=4,'model'=2], manual}", 2, propagated.MANUAL),
        ("{mesh['data'=4,'model'=2], [{'data':(1)2}, {}]}", 2, None),  # a sub-axis
        ("{mesh['x'=8], [{'x'}, {}]}", 2, None),  # not the user's mesh
        ("{mesh['data'=4,'model'=2], [{'data'}, {}]}", 3, None),
    ],
)
def test_xla_named_shardings_read_as_mesh_axes(sharding, rank, expected):
    """The form XLA writes from JAX 0.12: its mesh, with the user's names."""

    mesh = MESHES["auto"]()
    assert (
        propagated.entries(sharding, rank, groups.coordinates(mesh), mesh) == expected
    )


CACHED = """
import os, sys, tempfile
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jaxtyping_shard as jts
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
step = jax.jit(lambda a: jnp.sin(a) * 2)
x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, jax.P("data")))
step(x)  # in the persistent cache now
try:
    print("ROWS", len(jts.layouts(step, x).rows))
except RuntimeError as error:
    print("RAISED", error)
"""


def test_the_persistent_cache_never_gives_a_silent_report(tmp_path):
    """JAX's persistent cache drops dump options from its key: the compile is
    kept out of it (JAX <= 0.10), or the report says it could not read (0.12);
    never an empty report."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(
        [sys.executable, "-c", CACHED], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    if compat.JAX_VERSION >= (0, 12):
        assert "RAISED layouts: XLA wrote no module" in out.stdout
        assert "persistent compilation cache" in out.stdout
    else:
        assert re.search(r"ROWS [1-9]", out.stdout), out.stdout
