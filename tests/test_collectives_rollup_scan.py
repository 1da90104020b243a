"""The roll-up of stacked layers scanned over, whatever the scan's body is: a
lambda on the scan's line, a named function, that function under
`jax.checkpoint` (rematerialised, as the reference step's `Config.remat`
writes it), or one made by a factory that takes another attribute of the
module first (`scan(_layer(self.remat), x, self.blocks)`). In every form the
blocks roll up as one node, `blocks[*]`, and the body itself is no node, as a
lambda is none. A plain helper called outside the loop keeps its name, so the
rule does not hide functions. Explicit and Auto meshes.
"""

import jax
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat

from .helpers import MESHES, P, place
from .test_collectives_budget import load
from .test_collectives_rollup import adds_up


pytest.importorskip("equinox")
FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: stacks are known

PROGRAM = """
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

EXPLICIT = EXPLICIT_MESH


def dense(x, w, out):
    return jnp.einsum("bi,io->bo", x, w, out_sharding=out if EXPLICIT else None)


class Block(eqx.Module):
    w_in: jax.Array
    w_out: jax.Array

    def __call__(self, x):
        h = dense(x, self.w_in, P("data", "model"))  # column-parallel: no comm
        return dense(h, self.w_out, P("data", None))  # row-parallel: summed


def layer(x, block):
    return block(x), None


def _layer(remat: Optional[str]):
    def body(x, block):
        return block(x), None

    return body if remat is None else jax.checkpoint(body)


def head(x, w):
    return dense(x, w, P("data", None))


class Model(eqx.Module):
    blocks: Block
    w_head: jax.Array
    remat: Optional[str] = eqx.field(static=True)

    def __call__(self, x):
        if FORM == "lambda":
            x, _ = jax.lax.scan(lambda x, block: (block(x), None), x, self.blocks)
        elif FORM == "named":
            x, _ = jax.lax.scan(layer, x, self.blocks)
        elif FORM == "checkpointed":
            x, _ = jax.lax.scan(jax.checkpoint(layer), x, self.blocks)
        else:
            x, _ = jax.lax.scan(_layer(self.remat), x, self.blocks)
        return head(x, self.w_head)


def step(model, x):
    return jax.value_and_grad(lambda m: m(x).sum())(model)
"""

FORMS = ("lambda", "named", "checkpointed", "factory")


def report_of(tmp_path, form, kind):
    source = PROGRAM.replace("EXPLICIT_MESH", str(kind == "explicit"))
    module = load(tmp_path, form, source.replace("FORM", repr(form)))
    mesh = MESHES[kind]()
    blocks = module.Block(
        place(mesh, (3, 16, 32), P(None, None, "model")),
        place(mesh, (3, 32, 16), P(None, "model", None)),
    )
    model = module.Model(
        blocks, place(mesh, (16, 16), P("model", None)), remat="checkpoint_dots"
    )
    x = place(mesh, (8, 16), P("data", None))
    with jax.set_mesh(mesh):
        return jts.collectives(module.step, model, x)


def names(root):
    return [n.name for n in root.walk()]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("form", FORMS)
def test_the_scanned_blocks_are_one_node_whatever_the_body(tmp_path, form, kind):
    report = report_of(tmp_path, form, kind)
    root = adds_up(report)
    assert report.count > 0
    if not FRAMES:  # JAX 0.8: one frame per op, no functions; every part at the root
        assert root.children == ()
        return
    found = {".".join(p.path) for r in report.rows for p in r.parts}
    # The blocks' row-parallel product, summed over `model`, inside the scan.
    assert "Model.blocks[*].dense" in found, found
    blocks = root.find("Model.blocks[*]")
    assert blocks is not None and blocks.count > 0, str(root)
    assert blocks.forward.count > 0 and blocks.backward.count > 0
    for row in report.rows:
        for part in row.parts:
            if "blocks[*]" in part.path:
                assert row.in_loop, row
    # The body is no node of its own, nor is the block's class, nor the
    # attribute the factory took first.
    assert not {"layer", "body", "Block", "remat[*]"} & set(names(root)), str(root)
    # A plain helper called outside the loop keeps its name.
    assert "Model.head.dense" in found, found
    assert root.find("Model.head") is not None
