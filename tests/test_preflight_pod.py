"""The reference program's pod step with its temporaries counted (issue 36 item
6): `examples/transformer`'s production config (about 7 B parameters, 32
layers) on its 4,096-device pod, compiled on forced CPU devices
(`check_mesh="cpu"`, the mesh folded to 2,048 in one process), fits the 16 GiB
per device it is preflighted against only with its scanned layers
rematerialised (`Config.remat`); without, the temporaries alone are over twice
the budget, and preflight fails naming them.

`memory_analysis()` is deterministic: the figures are asserted as bounds that
hold on every supported JAX release (7.1 GiB of temporaries on JAX 0.10, 6.8 on
0.8, 7.2 on 0.12; without remat 35 GiB). Each test is one compile of the
32-layer step on 2,048 CPU devices (about 10 s).
"""

import dataclasses

import pytest

import jaxtyping_shard as jts
from examples.transformer import preflight as example


BUDGET = 16 * 2**30  # the example's budget per device (README)


def test_the_pod_step_with_its_temporaries_fits_its_budget():
    mesh = example.make_mesh((512, 8), "auto")
    report = example.preflight(example.POD, mesh, check_mesh="cpu", hbm_bytes=BUDGET)
    assert example.POD.remat == "dots_with_no_batch_dims_saveable"
    assert report.check_mesh_method == "folded"
    assert "('data': 256, 'model': 8; Auto axes): 2,048 forced CPU" in (
        report.checks.compiled_on
    )
    # Every check XLA decides ran there; what is not checked is named: the
    # inputs' own layouts (`jax.eval_shape` gives none on Auto axes).
    assert report.checks.compile_time > 0
    (unchecked,) = report.checks.not_checked
    assert "input leaves given without a sharding" in unchecked
    # Counted, and within: the budget now holds with the temporaries in it.
    assert report.temporary_bytes is not None and report.peak_bytes is not None
    assert 6 * 2**30 < report.temporary_bytes < 8 * 2**30
    assert report.budget_bytes == report.peak_bytes < BUDGET
    assert not report.over_budget and "within the budget of 16.0 GiB" in str(report)
    # What remains largest: the 32 layers' saved inputs and matmul outputs,
    # stacked by the scan (2 GiB), no longer the attention scores.
    first = report.temporaries[0]
    assert first.largest_bytes <= 2 * 2**30
    scores = [t for t in report.temporaries if "scores = jnp.einsum" in t.where]
    assert all(t.largest_bytes <= 128 * 2**20 for t in scores)


def test_without_remat_the_temporaries_are_over_the_budget_named():
    """On 256 x 8 itself (2,048 devices, one process): the compile the folded
    pod's is."""
    config = dataclasses.replace(example.POD, remat=None)
    mesh = example.make_mesh((256, 8), "auto")
    with pytest.raises(jts.ShardingTypeCheckError) as info:
        example.preflight(config, mesh, check_mesh="cpu", hbm_bytes=BUDGET)
    report = info.value.report
    assert report.check_mesh_method == "one process"
    assert report.temporary_bytes > 2 * BUDGET  # 35 GiB
    assert report.total_bytes < 2**30  # arguments and results alone fit
    text = str(info.value)
    assert "is over the budget hbm_bytes=16.0 GiB" in text and "+ temporaries" in text
    # Without remat the scan's body is a lambda on the scan's own line.
    assert "temporary at model.py:" in text and "jax.lax.scan(lambda x, block" in text
    assert "rematerialise what the temporaries keep" in text
