"""`jts.preflight(..., check_mesh="cpu")`: the step compiled on the production
mesh itself, real, of forced CPU devices in a child process (issue 36 item 1),
and the budgets that compile makes exact (item 3).

Each test that compiles starts one child (about 3 s of its own start); the mesh
is 256 devices (32 x 8), big enough that its sizes are not the suite's 4 x 2.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import jaxtyping_shard as jts
from jaxtyping_shard import Float
from jaxtyping_shard._report import cpu_mesh
from jaxtyping_shard._report.text import format_bytes


TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
W = Float[Array, "e m@model"]
X = Float[Array, "b@data e"]
H = Float[Array, "b@data m@model"]
B = Float[Array, "b"]  # no sharding: replicated


def pod(kind, shape=(32, 8)):
    return AbstractMesh(shape, ("data", "model"), axis_types=(TYPES[kind],) * 2)


def shapes():
    return (
        jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
        jax.ShapeDtypeStruct((4096, 1024), jnp.float32),
    )


def hidden(w: W, x: X) -> B:
    # A (4096/32 x 4096/8) temporary on each device, read twice; the last sum
    # is an all-reduce over `model`, 8 devices to a group.
    h = jnp.tanh(x @ w)
    return (h * h.sum(axis=0)).sum(axis=1)


@jts.jaxtyped(typechecker=beartype)
def over_model(y: X) -> H:
    return y * 2  # XLA keeps `e` whole: a mismatch only XLA's partitioner sees


def planted(w: W, x: X) -> B:
    over_model(x)
    return hidden(w, x)


@pytest.fixture(scope="module")
def compiled():
    """One child compile per kind, shared: the reports of `hidden` on 256."""
    return {
        k: jts.preflight(hidden, *shapes(), mesh=pod(k), check_mesh="cpu")
        for k in TYPES
    }


@pytest.mark.parametrize("kind", list(TYPES))
def test_compiled_on_the_production_mesh_with_its_temporaries(compiled, kind):
    report = compiled[kind]
    assert report.checks.compiled_on.startswith(
        "('data': 32, 'model': 8" + ("; Auto axes)" if kind == "auto" else ")")
    )
    assert "256 forced CPU devices in one child process" in report.checks.compiled_on
    assert report.check_mesh_method == "one process"
    memory = report.xla_memory
    # The child's compile has exactly the arguments preflight counts.
    assert memory.argument_size_in_bytes == report.argument_bytes
    assert report.temporary_bytes == memory.temp_size_in_bytes
    assert report.temporary_bytes >= (4096 // 32) * (4096 // 8) * 4
    assert report.peak_bytes == (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    # The largest temporary by line: the one `tanh(x @ w)` makes.
    first = report.temporaries[0]
    assert first.largest_bytes == (4096 // 32) * (4096 // 8) * 4
    assert "test_preflight_cpu.py" in first.where and "x @ w" in first.where
    assert "largest temporaries (by line)" in str(report)
    peak = format_bytes(report.peak_bytes)
    assert f"with XLA's temporaries {format_bytes(report.temporary_bytes)}" in (
        report.headline()
    )
    assert f"the peak is {peak}" in report.headline()
    assert report.peak_bytes > report.total_bytes


@pytest.mark.parametrize("kind", list(TYPES))
def test_collectives_at_the_real_group_sizes(compiled, kind):
    rows = compiled[kind].collectives.rows
    reduce = [r for r in rows if r.kind == "all-reduce" and r.axes == ("model",)]
    assert reduce and all(r.group_size == 8 for r in reduce)
    assert "test_preflight_cpu.py" in str(reduce[0].parts[0].source)


def test_temporaries_equal_an_independent_compile_of_the_same_step(compiled):
    """The oracle: the step as `jts.jit` derives its shardings (what preflight
    compiles), compiled in a fresh process of 256 forced CPU devices."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        import jaxtyping_shard as jts
        from tests.test_preflight_cpu import hidden
        mesh = jax.make_mesh((32, 8), ("data", "model"),
                             axis_types=(AxisType.Auto,) * 2)
        w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "model")))
        x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32,
                                 sharding=NamedSharding(mesh, P("data", None)))
        step = jts.jit(hidden, in_shardings="annotations",
                       out_shardings="annotations")
        with jax.set_mesh(mesh):
            c = step.lower(w, x).compile()
        print(c.memory_analysis().temp_size_in_bytes)
        """
    )
    env = cpu_mesh._environment(256)
    env.pop(cpu_mesh.CHILD_ENV)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert int(done.stdout.split()[-1]) == compiled["auto"].temporary_bytes


def test_a_planted_auto_mismatch_is_caught_at_the_real_sizes():
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(planted, *shapes(), mesh=pod("auto"), check_mesh="cpu")
    text = str(info.value)
    assert "1. " in text and "the return value of `over_model`" in text
    assert "XLA sharded it as `float32[4096@data,1024]`" in text
    assert "('data': 32, 'model': 8; Auto axes)" in text
    assert "'data': 4" not in text  # not a small check mesh's verdict
    # Without the compile, the same check is named as not run, never passed.
    report = jts.preflight(planted, *shapes(), mesh=pod("auto"))
    assert not report.checks.complete
    assert "the return value of `over_model`" in report.checks.not_checked[0]


@pytest.mark.parametrize("kind", list(TYPES))
def test_temporaries_over_the_budget_fail_naming_them(compiled, kind):
    fits = compiled[kind].total_bytes + 1  # arguments and results fit; not all
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        jts.preflight(
            hidden, *shapes(), mesh=pod(kind), check_mesh="cpu", hbm_bytes=fits
        )
    text = str(info.value)
    assert "is over the budget hbm_bytes=" in text and f"({fits} bytes)" in text
    assert "+ temporaries" in text
    assert "temporary at test_preflight_cpu.py:" in text and "x @ w" in text
    assert info.value.report.over_budget
    # Traced only, temporaries are unknown, and said to be.
    report = jts.preflight(hidden, *shapes(), mesh=pod(kind), hbm_bytes=fits)
    assert report.temporary_bytes is None and report.peak_bytes is None
    assert "temporaries not counted" in report.headline()
    with pytest.raises(jts.ShardingTypeCheckError, match="temporaries not counted"):
        jts.preflight(hidden, *shapes(), mesh=pod(kind), hbm_bytes=1024)


def test_the_child_is_bounded_and_cleaned_up(monkeypatch):
    monkeypatch.setattr(cpu_mesh, "TIMEOUT_S", 0.05)
    with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
        jts.preflight(hidden, *shapes(), mesh=pod("auto"), check_mesh="cpu")
    # subprocess.run killed and reaped it: no child of ours is left.
    assert not _children()


def test_a_step_the_child_cannot_import_is_refused():
    def local(w: W, x: X) -> B:
        return (x @ w).sum(axis=1)

    with pytest.raises(ValueError, match="not found as `tests.test_preflight_cpu"):
        jts.preflight(jax.jit(local), *shapes(), mesh=pod("auto"), check_mesh="cpu")


def _children():
    own = str(os.getpid())
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pid.isdigit() and fields[1] == own:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if b"cpu_child" in file.read():
                    found.append(pid)
    return found


LogicalW = Float[Array, "embed mlp", jts.Logical]
LogicalX = Float[Array, "batch embed", jts.Logical]
RULES = {"batch": "data", "mlp": "model", "embed": None}


@jts.jit(in_shardings="annotations", out_shardings="annotations")
def logical(w: LogicalW, x: LogicalX) -> LogicalX:
    return jnp.tanh(x @ w) @ w.T


def test_a_jts_jit_step_under_rules_is_compiled_under_them():
    """The child imports a `jts.jit` object by its name and runs under the rules
    in force here; a table that lays `x` out otherwise is the child's too."""
    mesh = pod("auto")
    w, x = (
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec))
        for s, spec in zip(shapes(), (P(None, "model"), P("data", None)))
    )
    report = jts.preflight(logical, w, x, mesh=mesh, check_mesh="cpu", axis_rules=RULES)
    assert report.checks.complete and report.temporary_bytes > 0
    (out,) = [leaf for leaf in report.leaves if leaf.group == "outputs"]
    assert out.spec == P("data", None) and out.bytes_per_device == 128 * 1024 * 4
    wrong = jax.ShapeDtypeStruct(
        (4096, 1024), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    with pytest.raises(jts.ShardingTypeCheckError, match="`x` of `logical`"):
        jts.preflight(
            logical, shapes()[0], wrong, mesh=mesh, check_mesh="cpu", axis_rules=RULES
        )


SCRIPT = """
import jax, jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jaxtyping import Array
import jaxtyping_shard as jts
from jaxtyping_shard import Float

def step(w: Float[Array, "e m@model"], x: Float[Array, "b@data e"]):
    return jnp.tanh(x @ w).sum()

def main():
    mesh = AbstractMesh((16, 4), ("data", "model"), (AxisType.Auto,) * 2)
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    report = jts.preflight(step, w, x, mesh=mesh, check_mesh="cpu")
    print("devices here", len(jax.devices()), "compiled on", report.checks.compiled_on)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_step_in_a_script(tmp_path, guarded):
    """A script's step is found in the child, which loads the script as
    `__mp_main__`; one whose top-level code is not under the guard is refused
    there, saying so, rather than run again."""
    tail = 'if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"
    script = tmp_path / "train_check.py"
    script.write_text(SCRIPT + tail)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("XLA_FLAGS", None)  # the script's own devices: one CPU
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, timeout=300
    )
    out, err = done.stdout.decode(), done.stderr.decode()
    if guarded:
        assert done.returncode == 0, err[-2000:]
        # The caller's devices untouched: one, as it started; the child had 64.
        assert "devices here 1 compiled on ('data': 16, 'model': 4; Auto" in out
        assert "64 forced CPU devices in one child process" in out
    else:
        assert done.returncode != 0
        assert "called inside its own child process" in err
        assert "if __name__ == '__main__':" in err
