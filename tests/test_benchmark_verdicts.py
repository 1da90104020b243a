"""The verdict of benchmarks' steady-state step figures (benchmarks/README,
"Steady-state step figures"): a timed ratio that misses its target passes as a
fixed cost only when the measured host-side cost is within the target at the
step's time, the compiled program is plain's and the timed ratio is within two
standard errors of 1.00; every other miss stands."""

import math
import pathlib
import random
import statistics
import sys

import pytest


sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))
import _timing  # noqa: E402


def sides(spread, shift, n=301, step=0.005, seed=0):
    """Seconds a call of a baseline and a candidate `shift` x slower, each call
    off by a relative `spread`."""
    r = random.Random(seed)
    base = [step * (1 + r.gauss(0, spread)) for _ in range(n)]
    cand = [step * shift * (1 + r.gauss(0, spread)) for _ in range(n)]
    return cand, base


def row(cand, base, target=1.01):
    return _timing.figure("x", "x", cand, base, target, f"≤ {target}")


def test_the_standard_error_is_a_medians():
    cand, base = sides(0.17, 1.0, n=303)
    error = _timing.ratio_error(cand, base)
    ratios = [c / b for c, b in zip(cand, base)]
    # A median's standard error, 1.2533 sd / sqrt(n), of the per-repeat ratios:
    assert error == pytest.approx(1.2533 * statistics.stdev(ratios) / math.sqrt(303))
    # about 2% for calls that vary by 17%, as this machine's do (README)
    assert 0.015 < error < 0.025
    assert _timing.ratio_error([1.0], [1.0]) is None
    assert row(cand, base)["ratio_se"] == pytest.approx(error, abs=1e-4)


def noisy_miss():
    """A ratio above 1.01 that this noise cannot tell from 1.00."""
    for seed in range(200):
        cand, base = sides(0.17, 1.0, seed=seed)
        fig = row(cand, base)
        if fig["verdict"] == "MISS" and fig["ratio"] - 1 <= 2 * fig["ratio_se"]:
            return fig
    raise AssertionError("no noisy miss in 200 seeds")


def test_a_miss_within_noise_with_no_host_cost_passes_as_a_fixed_cost():
    fig = _timing.judge_fixed_cost(noisy_miss(), 0.0, 0.005, "identical")
    assert fig["verdict"] == "PASS (fixed cost)"
    assert fig["host_cost_us"] == 0.0 and fig["host_cost_share"] == 0.0
    other_order = _timing.judge_fixed_cost(
        noisy_miss(), 2.5, 0.005, "same instructions, other order"
    )
    assert other_order["verdict"] == "PASS (fixed cost)"
    assert other_order["host_cost_share"] == pytest.approx(2.5 / 5000)


@pytest.mark.parametrize(
    "host_us, same",
    [
        (60.0, "identical"),  # 1.2% of a 5 ms step: over the target's 50 µs
        (None, "identical"),  # a host cost nobody measured
        (0.0, "different"),  # another program
        (0.0, "not compared"),  # --smoke: the programs are not compared
    ],
)
def test_every_other_miss_stands(host_us, same):
    fig = _timing.judge_fixed_cost(noisy_miss(), host_us, 0.005, same)
    assert fig["verdict"] == "MISS"


def test_a_real_slowdown_stays_a_miss_whatever_the_counts():
    # 5% slower with little noise: far more than two standard errors above 1.
    cand, base = sides(0.02, 1.05)
    fig = row(cand, base)
    assert fig["verdict"] == "MISS" and fig["ratio"] - 1 > 2 * fig["ratio_se"]
    assert _timing.judge_fixed_cost(fig, 0.0, 0.005, "identical")["verdict"] == "MISS"


def test_a_pass_is_left_alone_and_a_report_is_not_judged():
    cand, base = sides(0.001, 1.0)
    fig = _timing.judge_fixed_cost(row(cand, base), 0.0, 0.005, "identical")
    assert fig["verdict"] == "PASS"
    report = _timing.figure("x", "x", cand, base, None, "report")
    assert _timing.judge_fixed_cost(report, 0.0, 0.005, "identical")["verdict"] == (
        "report"
    )
