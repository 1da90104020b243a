"""The transformer example (examples/transformer): its loss, its source, its CI run.

- The same program, changing only the rules table, trains as data parallel,
  FSDP and FSDP + tensor parallel on a 4x2 Explicit and Auto mesh, and its losses
  equal those of a run on one device.
- Its source writes no layout outside the annotations and the one rules table.
- It runs as a job of 2 processes x 4 devices (`--processes 2`), its step's
  collectives as in its baseline (`collectives.json`) there too.
"""

import ast
import functools as ft
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from examples.transformer import train


ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "transformer"
STEPS = 3


@ft.cache
def _reference() -> tuple[float, ...]:
    return tuple(
        train.train(
            "fsdp_tp", "explicit", STEPS, mesh_shape=(1, 1), devices=jax.devices()[:1]
        )
    )


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("layout", ["dp", "fsdp", "fsdp_tp"])
def test_loss_equals_one_device(layout, kind):
    losses = train.train(layout, kind, STEPS)
    assert losses == pytest.approx(_reference(), rel=1e-5)
    assert len(set(losses)) == STEPS  # trained: the loss moves every step


@pytest.mark.parametrize(
    "before, after",
    [
        (("fsdp", "explicit", (4, 2)), ("fsdp_tp", "auto", (4, 2))),
        (("fsdp_tp", "auto", (4, 2)), ("fsdp", "explicit", (2, 2))),
    ],
    ids=["fsdp-explicit-to-fsdp_tp-auto", "fsdp_tp-auto-8-to-fsdp-explicit-4"],
)
def test_resume_from_orbax_on_another_layout(tmp_path, before, after):
    """Saved under one layout and mesh, restored onto another (its target from
    `jts.abstract`, verified by `check_tree`), trained on: the losses of one
    uninterrupted run on one device."""
    from examples.transformer.checkpoint import train_and_resume

    losses = train_and_resume(str(tmp_path / "ckpt"), before, after, steps=(2, 1))
    assert losses == pytest.approx(_reference(), rel=1e-5)


def test_layouts_differ_only_by_rules_table():
    # The three runs above are one program; what differs is the table in force,
    # and under it the parameters really are laid out differently.
    import jaxtyping_shard as jts
    from examples.transformer.layout import RULES
    from examples.transformer.model import Config

    mesh = train.make_mesh((4, 2), "explicit")
    specs = {}
    for layout in ("dp", "fsdp", "fsdp_tp"):
        with jax.set_mesh(mesh), jts.axis_rules(RULES[layout]):
            shapes = jts.abstract(
                train.Transformer, jax.random.key(0, impl="rbg"), Config(), mesh=mesh
            )
        specs[layout] = tuple(shapes.blocks.attn.wq.sharding.spec)
    # The blocks are stacked (`jts.Stacked[Block]`): first the layer dim, whole.
    assert specs == {
        "dp": (None, None, None, None),
        "fsdp": (None, ("data", "model"), None, None),
        "fsdp_tp": (None, "data", "model", None),
    }


# The source rule. In examples/transformer/*.py a layout is written only as an
# annotation (model.py, the fields of the classes) and in the one rules table
# (layout.py). Precisely:
# - no import or use of PartitionSpec, NamedSharding, shard_map, device_put,
#   with_sharding_constraint, jax.sharding.reshard, jax.jit,
#   make_array_from_process_local_data (any module, any alias);
# - no `in_specs` / `out_specs` keywords; `in_shardings` / `out_shardings` only
#   as "annotations"; an op's `out_sharding=` only as `jts.out_sharding(...)`;
# - `jts.reshard`, `jts.out_sharding`, `jts.place`, `jts.local_rows` take their
#   layout as a name (an annotation alias) or not at all, never a literal;
# - the mesh axis names ("data", "model") appear as strings only in layout.py
#   and in `train.make_mesh` (the mesh itself).
FORBIDDEN_NAMES = {
    "PartitionSpec",
    "NamedSharding",
    "shard_map",
    "device_put",
    "with_sharding_constraint",
    "make_array_from_process_local_data",
    "P",
}
MESH_AXES = {"data", "model"}
LAYOUT_CALLS = {
    "reshard": 1,
    "as_used": 1,
    "out_sharding": 0,
    "place": 1,
    "local_rows": 0,
}


def layout_violations(source: str, filename: str) -> list[str]:
    """Every place `source` writes a layout outside the allowed ones."""
    tree = ast.parse(source)
    found = []
    where = lambda node: f"{filename}:{node.lineno}"  # noqa: E731
    parents = {
        child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)
    }

    def inside_make_mesh(node) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef) and node.name == "make_mesh":
                return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                if alias.name.split(".")[-1] in FORBIDDEN_NAMES | {"reshard"}:
                    found.append(f"{where(node)}: imports {alias.name}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"{where(node)}: uses {node.id}")
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in FORBIDDEN_NAMES:
                found.append(f"{where(node)}: uses .{node.attr}")
            elif node.attr in ("reshard", "jit") and owner != "jts":
                found.append(f"{where(node)}: uses .{node.attr} (only jts.{node.attr})")
        elif isinstance(node, ast.keyword):
            value = node.value
            if node.arg in ("in_specs", "out_specs"):
                found.append(f"{where(value)}: {node.arg}=")
            elif node.arg in ("in_shardings", "out_shardings") and not (
                isinstance(value, ast.Constant) and value.value == "annotations"
            ):
                found.append(f"{where(value)}: {node.arg}= not 'annotations'")
            elif node.arg == "out_sharding" and not (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "out_sharding"
            ):
                found.append(f"{where(value)}: out_sharding= not jts.out_sharding(...)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            index = LAYOUT_CALLS.get(node.func.attr)
            if index is not None and len(node.args) > index:
                if not isinstance(node.args[index], ast.Name):
                    found.append(
                        f"{where(node)}: {node.func.attr}() with a literal layout"
                    )
        elif isinstance(node, ast.Constant) and node.value in MESH_AXES:
            if filename != "layout.py" and not inside_make_mesh(node):
                found.append(f"{where(node)}: mesh axis {node.value!r}")
    return found


def test_example_writes_layouts_only_in_annotations_and_rules():
    files = sorted(EXAMPLE.glob("*.py"))
    assert {f.name for f in files} >= {"model.py", "train.py", "optim.py", "layout.py"}
    found = [v for f in files for v in layout_violations(f.read_text(), f.name)]
    assert found == []


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("from jax.sharding import PartitionSpec as P\n", "imports"),
        ("x = jax.device_put(x, s)\n", "uses .device_put"),
        ("y = jax.lax.with_sharding_constraint(y, s)\n", "with_sharding_constraint"),
        ("y = jax.sharding.reshard(y, s)\n", "only jts.reshard"),
        ("f = jax.jit(f, out_shardings=s)\n", "only jts.jit"),
        ("f = jts.jit(f, in_shardings=s)\n", "not 'annotations'"),
        ("y = jnp.einsum('ab,bc->ac', a, b, out_sharding=s)\n", "not jts.out_sharding"),
        ("y = jts.reshard(y, Float[Array, 'a b', L])\n", "literal layout"),
        ("rules = {'batch': 'data'}\n", "mesh axis 'data'"),
        ("g = shard_map(f, mesh=m, in_specs=s, out_specs=s)\n", "in_specs"),
    ],
)
def test_source_rule_catches_a_planted_layout(line, fragment):
    source = (EXAMPLE / "model.py").read_text() + line
    found = layout_violations(source, "model.py")
    assert any(fragment in v for v in found), found


def test_two_processes():
    """The example's own `--processes 2` run: 2 processes x 4 devices, loss checked."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    result = subprocess.run(
        [sys.executable, "-m", "examples.transformer", "--processes", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for i in range(2):
        assert f"WORKER {i} OK" in output, output[-6000:]
        for kind in ("explicit", "auto"):
            assert (
                f"process {i}: fsdp_tp on a {kind} 4x2 mesh (2 process(es))" in output
            )
            # The step's collectives match its baseline on 2 processes too.
            name = {"explicit": "collectives", "auto": "collectives_auto"}[kind]
            assert (
                f"process {i}: collectives of the fsdp_tp step on the {kind} mesh "
                f"as in {name}.json" in output
            )
