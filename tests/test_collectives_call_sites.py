"""Call sites, not helpers: a program whose every matmul goes through one
`dense` helper, and whose every constraint goes through one `constrain`, gets a
row and a baseline key per call site; a layout bug planted at one site is
blamed on that site (not the helper, not another site), also when XLA merges
its collective with another site's; the rule itself on chains of frames; and a
baseline of format 1 still read.
"""

import json

import jax
import pytest

import jaxtyping_shard as jts
from jaxtyping_shard._core import compat
from jaxtyping_shard._report import call_sites
from jaxtyping_shard._report.sources import Frame

from .helpers import MESHES, P, place
from .test_collectives_budget import load


FRAMES = compat.hlo_stack_frames_usable()  # JAX >= 0.9: stacks are known

PROGRAM = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

EXPLICIT = {explicit}
OUT = P("data", None) if EXPLICIT else None
RESHARD = jax.sharding.reshard if EXPLICIT else jax.lax.with_sharding_constraint


def dense(x, w):
    return jnp.einsum("bi,io->bo", x, w, out_sharding=OUT)


def constrain(x, spec):
    return RESHARD(x, spec)


def attention(x, wq, wo):
    q = dense(x, wq)  # site q
    q = constrain(q, P("data", "model"))  # site q layout
    return dense(q, wo)  # site o


def ffn(x, w_in, w_out):
    h = dense(x, w_in)  # site in
    h = constrain(h, {ffn_layout})  # site h layout
    return dense(h, w_out)  # site out


def step(x, layers):
    for wq, wo, w_in, w_out in layers:  # two layers: the same lines
        x = attention(x, wq, wo)
        x = ffn(x, w_in, w_out)
    return x
"""

SITES = {  # marker: the text of the site's line
    "q": "q = dense(x, wq)  # site q",
    "o": "return dense(q, wo)  # site o",
    "in": "h = dense(x, w_in)  # site in",
    "out": "return dense(h, w_out)  # site out",
}


def program(tmp_path, name, kind, ffn_layout='P("data", "model")'):
    source = PROGRAM.format(explicit=kind == "explicit", ffn_layout=ffn_layout)
    return load(tmp_path, name, source)


def report_of(module, mesh, x_spec=P("data", "model")):
    # Every weight split over `model` on its input dim: each product contracts
    # over `model` and reduces over it.
    x = place(mesh, (8, 16), x_spec)
    weights = [place(mesh, (16, 16), P("model", None)) for _ in range(4)]
    with jax.set_mesh(mesh):
        return jts.collectives(module.step, x, [weights, weights])


@pytest.fixture(params=["explicit", "auto"])
def kind(request):
    return request.param


def texts(report):
    return [str(s) for r in report.rows for s in r.sites]


@pytest.mark.skipif(not FRAMES, reason="JAX 0.8 keeps one frame per op")
def test_every_matmul_through_one_helper_one_row_per_site(tmp_path, kind):
    mesh = MESHES[kind]()
    report = report_of(program(tmp_path, "v1", kind), mesh)
    reductions = [
        p for r in report.rows for p in r.parts if r.over == "model" and p.site
    ]
    by_site = {p.site.text: p.site for p in reductions}
    # The four call sites of `dense`, never the helper's own line.
    assert set(SITES.values()) <= set(by_site)
    assert 'return jnp.einsum("bi,io->bo", x, w, out_sharding=OUT)' not in by_site
    for text in SITES.values():
        site = by_site[text]
        assert site.helpers and site.helpers[0].function == "dense"
        assert site.via == ('prog.py: return jnp.einsum("bi,io->bo", x, w, '
                            "out_sharding=OUT)",)  # fmt: skip
        assert "(via `dense` at prog.py:" in str(site)
    # Two layers reach each site through the same lines: one site, twice.
    keys = {p.site.key for p in reductions if p.site.text in SITES.values()}
    assert len(keys) == 4
    table = str(report)
    for text in SITES.values():
        assert text in table


@pytest.mark.skipif(not FRAMES, reason="JAX 0.8 keeps one frame per op")
def test_a_planted_bug_is_blamed_on_its_site(tmp_path):
    # Explicit axes: the constraint's gather stays in `ffn` (on Auto axes the
    # partitioner may move it up into the layer before, from JAX 0.12: the
    # weight planted in the test below is the Auto case).
    kind = "explicit"
    mesh = MESHES[kind]()
    path = tmp_path / "budget.json"
    good = program(tmp_path, "good", kind)
    report_of(good, mesh).save(path)
    report_of(good, mesh).check(path)  # the same program: as in the baseline
    saved = json.loads(path.read_text())["jax"][jax.__version__]["collectives"]
    assert all(e["where"] != "prog.py: return RESHARD(x, spec)" for e in saved)
    assert any(e.get("via") for e in saved)  # a site inside a helper says it

    # One site's constraint asks for the batch whole: an all-gather there.
    bad = program(tmp_path, "bad", kind, ffn_layout='P(None, "model")')
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report_of(bad, mesh).check(path)
    text = str(caught.value)
    problems = [line for line in text.splitlines() if line[:4].strip().endswith(".")]
    assert problems, text
    for line in problems:
        # Each one at the planted site or after it in `ffn`: never the helper
        # alone, never `attention`'s sites.
        assert "in `ffn`" in line or "site out" in line, text
        assert "# site q " not in line and "# site o " not in line, text
    assert any("new: all-gather over data" in line for line in problems), text


def test_through_the_caches_a_warm_step_still_blamed(tmp_path):
    mesh = MESHES["auto"]()
    path = tmp_path / "budget.json"
    module = program(tmp_path, "warm", "auto")
    step = jax.jit(module.step)
    x = place(mesh, (8, 16), P("data", "model"))
    weights = [place(mesh, (16, 16), P("model", None)) for _ in range(4)]
    with jax.set_mesh(mesh):
        step(x, [weights, weights])  # warm: traced and compiled
        jts.collectives(step, x, [weights, weights]).save(path)
        # The second layer's `w_in` laid out wrong: its input dim over `data`.
        wrong = [*weights[:2], place(mesh, (16, 16), P("data", None)), weights[3]]
        step(x, [weights, wrong])
        report = jts.collectives(step, x, [weights, wrong])
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(path)
    text = str(caught.value)
    problems = [line for line in text.splitlines() if line[:4].strip().endswith(".")]
    assert problems, text
    if FRAMES:  # JAX 0.8 keeps the helper's line alone: no call sites there
        assert all("in `ffn`" in line for line in problems), text
        assert "# site q " not in text and "# site o " not in text


def frames(*lines):
    return tuple(Frame("/p/prog.py", f"f{n}", n) for n in lines)


def test_the_rule_on_chains():
    helper, via_helper = frames(10, 20, 99), frames(10, 21, 99)
    nested = [frames(5, 6, 30, 99), frames(5, 6, 31, 99)]  # helper in a helper
    alone = frames(40, 99)  # a line no other chain passes through
    depths = call_sites.depths([helper, via_helper, *nested, alone, alone])
    assert depths[helper] == depths[via_helper] == 2  # the frame calling it
    assert [depths[c] for c in nested] == [3, 3]  # out to where they part
    assert depths[alone] == 1  # itself: the shared caller is never part of it
    # A chain cut short (as JAX keeps some, in nested traces) differs in
    # nothing from the whole one: neither tells a site apart.
    short, long = frames(7, 99), frames(7, 99, 100)
    assert call_sites.depths([short, long]) == {short: 1, long: 1}
    # A nested trace's stack joined to the step's line, skipping the frames
    # between (the backward pass of a scan's body): the same call.
    forward, backward = frames(73, 98, 180, 181, 68, 1), frames(73, 98, 180, 68, 1)
    assert call_sites.depths([forward, backward]) == {forward: 1, backward: 1}
    cut = frames(10, 20)  # the first helper's chain, cut short: still site 20
    assert call_sites.depths([helper, via_helper, cut])[helper] == 2


@pytest.mark.skipif(not FRAMES, reason="JAX 0.8 keeps one frame per op")
def test_merged_reductions_keep_each_sites_share(tmp_path):
    mesh = MESHES["auto"]()
    source = """
import jax.numpy as jnp


def dense(x, w):
    return jnp.einsum("bi,io->bo", x, w)


def step(x, w1, w2):
    a = dense(x, w1)  # site a
    b = dense(x, w2)  # site b
    return a, b
"""
    module = load(tmp_path, "merged", source)
    x = place(mesh, (8, 16), P(None, "data"))

    def run(cols_b):
        w1 = place(mesh, (16, 4), P("data", None))
        w2 = place(mesh, (16, cols_b), P("data", None))
        with jax.set_mesh(mesh):
            return jts.collectives(module.step, x, w1, w2)

    report = run(4)
    merged = [r for r in report.rows if r.merged]
    parts = [p for r in report.rows for p in r.parts if r.kind == "all-reduce"]
    shares = {p.site.text: p.bytes for p in parts}
    assert set(shares) == {"a = dense(x, w1)  # site a", "b = dense(x, w2)  # site b"}
    assert sum(shares.values()) == sum(r.bytes for r in report.rows)
    path = tmp_path / "budget.json"
    report.save(path)
    grown = run(8)  # site b's reduction twice as large
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        grown.check(path)
    text = str(caught.value)
    assert "1. grown: all-reduce over data at prog.py:" in text
    assert "site b" in text and "site a" not in text
    assert "2." not in text.split("\n", 1)[1].split("If the change")[0]
    # XLA's all-reduce combiner (on CPU too) merged the two: the case.
    (row,) = merged
    assert len(row.sites) == 2 and len(row.parts) == 2
    assert "merged by XLA from 2 lines" in str(report)
    (grown_row,) = [r for r in grown.rows if r.merged]  # merged again, grown
    assert {p.site.text: p.bytes for p in grown_row.parts}[
        "b = dense(x, w2)  # site b"
    ] == 2 * shares["b = dense(x, w2)  # site b"]


def test_a_format_1_baseline_is_read_by_line(tmp_path):
    mesh = MESHES["auto"]()
    module = program(tmp_path, "legacy", "auto")
    report = report_of(module, mesh)
    path = tmp_path / "budget.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "jaxtyping_shard collectives baseline 2"
    # As format 1 wrote it: keyed by the line that made each operand.
    from jaxtyping_shard._report import budget

    old = list(budget.entries(report, legacy=True).values())
    assert all("via" not in e for e in old)
    data["format"] = "jaxtyping_shard collectives baseline 1"
    data["jax"][jax.__version__]["collectives"] = old
    path.write_text(json.dumps(data))
    report.check(path)  # the same program, judged by line
    dropped = [e for e in old if e["over"] == "model"][1:]
    data["jax"][jax.__version__]["collectives"] = [
        e for e in old if e["over"] != "model"
    ] + dropped
    path.write_text(json.dumps(data))
    with pytest.raises(jts.CollectiveBudgetError) as caught:
        report.check(path)
    assert "is of format 1, keyed by the line" in str(caught.value)
    report.save(path)  # rewritten: this release's section keyed by call site
    rewritten = json.loads(path.read_text())
    assert rewritten["format"] == "jaxtyping_shard collectives baseline 2"
    assert "keyed" not in rewritten["jax"][jax.__version__]
    report.check(path)
