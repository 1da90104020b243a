"""Issue 35 item 5: the reference program accumulates its gradients as JAX's
sharding-in-types documentation teaches, on the Explicit mesh.

The weights gathered once and marked `reduced` over `data`, the gradients
`unreduced` through the micro-batch scan, one reduction after it: the losses are
those of the per-micro-batch path (the Auto mesh's, `train.accumulate`) to
float tolerance, at 2 and 4 micro-batches; the gradients' reductions over
`data` leave the loop (the report names them deferred), and their bytes no
longer grow with the micro-batches. The Auto mesh keeps the old path.
"""

import jax
import numpy as np
import pytest

from examples.transformer import collectives as reference, train


@pytest.fixture
def micro(request, monkeypatch):
    monkeypatch.setattr(train, "MICRO", request.param)
    jax.clear_caches()  # `MICRO` is read when the step is traced
    yield request.param
    jax.clear_caches()


def per_micro_batch(monkeypatch):
    """The step as it was: each micro-batch's gradient reduced in the scan."""
    monkeypatch.setattr(train, "deferred_reduction", lambda params: False)
    jax.clear_caches()


def over_data(report, **where):
    rows = report.where(kind="all-reduce", axes="data", **where)
    return rows.count, rows.bytes


@pytest.mark.parametrize("micro", [2, 4], indirect=True)
def test_losses_equal_and_one_reduction_of_the_weights(micro, monkeypatch):
    losses = train.train("fsdp_tp", "explicit", steps=3)
    after = reference.report("explicit")
    per_micro_batch(monkeypatch)
    before = reference.report("explicit")
    expected = train.train("fsdp_tp", "explicit", steps=3)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    # Before: every gradient reduced inside the micro-batch loop.
    assert not before.where(deferred=True).rows
    assert over_data(before, loop="inside")[1] > 100_000 * micro // 2
    # After: the 8 weights' gradients reduced once, outside every loop, named
    # as the deferred reduction; only the norms' scales and the loss (a few
    # bytes a micro-batch) are reduced inside it.
    deferred = after.where(kind="all-reduce", axes="data", deferred=True)
    assert deferred.rows and all(not r.in_loop for r in deferred.rows)
    assert sum(p.deferred for r in deferred.rows for p in r.parts) == 8
    assert all(r.executions == 1 for r in deferred.rows)
    assert over_data(after, loop="inside")[1] < 1000 * micro
    assert over_data(after)[1] < over_data(before)[1] / (micro - 0.5)
    assert "[deferred reduction of unreduced over data]" in str(after)
    # The weights gathered once a step, not once a layer and micro-batch.
    gathers = after.where(kind="all-gather", axes="data")
    assert gathers.count == 8 and all(not r.in_loop for r in gathers.rows)
    assert before.where(kind="all-gather", axes="data").count > 8 * micro


@pytest.mark.parametrize("micro", [2, 4], indirect=True)
def test_deferred_bytes_do_not_grow_with_the_micro_batches(micro):
    report = reference.report("explicit")
    deferred = report.where(kind="all-reduce", axes="data", deferred=True)
    assert sum(p.bytes for r in deferred.rows for p in r.parts if p.deferred) == (
        61_440  # the 8 weights' gradients, 4 partial sums each: 2 * 3/4 of them
    )


def test_auto_mesh_keeps_the_per_micro_batch_path():
    report = reference.report("auto")
    assert not report.where(deferred=True).rows
    assert over_data(report, loop="inside")[1] > 100_000
    report.check(reference.baseline("auto"))
    # Its baseline is the Explicit mesh's no more: the Explicit step's
    # gradients are reduced at the scan's line, which the Auto baseline lacks.
    explicit = reference.report("explicit")
    explicit.check(reference.baseline("explicit"))
    with pytest.raises(Exception, match="new: all-reduce over data"):
        explicit.check(reference.baseline("auto"))


def test_other_layouts_train_alike():
    # Pure data parallelism and pure FSDP (over both axes) take the same path.
    one = train.train("dp", "explicit", steps=2, mesh_shape=(1, 1),
                      devices=jax.devices()[:1])  # fmt: skip
    for layout in ("dp", "fsdp"):
        np.testing.assert_allclose(
            train.train(layout, "explicit", steps=2), one, rtol=1e-5
        )
