"""The cost-model fit recovers known (o, w); its closed-form optimum matches a brute-force search."""

import math

import numpy as np
import pytest

from ddp_lab.analysis import cost_model as cm

OVERHEAD, W = 80e-6, 5e9   # 80 us per call, 5 GB/s


def _synthetic(rng, noise=0.05, outlier_frac=0.1):
    sizes = np.repeat(np.logspace(10, 30, 11, base=2), 20)          # 1 KiB .. 1 GiB, 20 samples each
    t = (OVERHEAD + sizes / W) * rng.lognormal(0.0, noise, sizes.size)
    slow = rng.random(sizes.size) < outlier_frac                      # descheduled iterations: 2-10x slower
    t[slow] *= rng.uniform(2, 10, slow.sum())
    return sizes, t


def test_fit_recovers_known_overhead_and_bandwidth():
    sizes, t = _synthetic(np.random.default_rng(0))
    fit = cm.fit_link(sizes, t)
    assert fit.overhead_s == pytest.approx(OVERHEAD, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(W, rel=0.05)
    assert fit.n_points == 11 and fit.rel_rms < 0.05
    # Plain least squares on the same data gets o badly wrong: the robust steps are what help.
    ols_o = np.polyfit(sizes, t, 1)[1]
    assert abs(ols_o - OVERHEAD) > 0.5 * OVERHEAD


def test_fit_exact_and_clamped():
    sizes = np.array([1e3, 1e6, 1e9])
    fit = cm.fit_link(sizes, OVERHEAD + sizes / W)
    assert fit.overhead_s == pytest.approx(OVERHEAD) and fit.bandwidth_Bps == pytest.approx(W)
    # Pure bandwidth (no overhead) data with a little noise: o stays >= 0.
    fit0 = cm.fit_link(sizes, sizes / W * np.array([1.01, 0.99, 1.0]))
    assert fit0.overhead_s >= 0 and fit0.bandwidth_Bps == pytest.approx(W, rel=0.02)
    with pytest.raises(ValueError, match="two distinct"):
        cm.fit_link([1e6, 1e6], [1e-3, 2e-3])


@pytest.mark.parametrize("s,o,w", [(37e6, 80e-6, 5e9), (500e6, 30e-6, 100e9), (4e9, 1e-3, 1e9), (1e6, 1e-3, 1e9)])
def test_optimum_matches_brute_force(s, o, w):
    ns = np.arange(1, 20001)
    brute_n = int(ns[np.argmin(cm.exposed_overhead(ns, s, o, w))])
    assert cm.best_bucket_count(s, o, w) == brute_n
    # Continuous optimum over bucket size: b* = sqrt(s*o*w), clipped at s (one bucket).
    bs = np.geomspace(1, s, 200001)
    brute_b = bs[np.argmin(cm.exposed_vs_bucket_bytes(bs, s, o, w))]
    assert cm.best_bucket_bytes(s, o, w) == pytest.approx(brute_b, rel=1e-3)


def test_by_hand():
    # s = 100 MB, o = 100 us, w = 10 GB/s: n* = sqrt(1e8 / (1e-4 * 1e10)) = 10 buckets of 10 MB,
    # exposed = 10 * 100us + 1e8 / (10 * 1e10) = 1 ms + 1 ms = 2 ms = 2*sqrt(s*o/w).
    assert cm.best_bucket_count(1e8, 1e-4, 1e10) == 10
    assert cm.best_bucket_bytes(1e8, 1e-4, 1e10) == pytest.approx(1e7)
    assert cm.exposed_overhead(10, 1e8, 1e-4, 1e10) == pytest.approx(2e-3)
    assert cm.exposed_overhead(10, 1e8, 1e-4, 1e10) == pytest.approx(2 * math.sqrt(1e8 * 1e-4 / 1e10))


@pytest.mark.parametrize("backward_s", [0.001, 0.01, 0.1, 1.0])
def test_pipeline_closed_form_matches_simulation(backward_s):
    s, o, w = 100e6, 200e-6, 10e9
    for n in range(1, 200):
        assert cm.pipeline_exposed(n, s, o, w, backward_s) == pytest.approx(
            cm.simulate_pipeline(n, s, o, w, backward_s), rel=1e-9, abs=1e-12)
    # Backlogged regime (comm slower than backward): optimum near sqrt(T/o).
    if s / w > backward_s:
        ns = range(1, 2000)
        best = min(ns, key=lambda n: cm.pipeline_exposed(n, s, o, w, backward_s))
        assert abs(best - math.sqrt(backward_s / o)) <= 1


def test_fit_from_benchmark_summaries():
    from ddp_lab.arithmetic.bandwidth import summarize_collective

    sizes = [2**20, 10 * 2**20, 100 * 2**20, 1000 * 2**20]
    jobs = [summarize_collective("all_reduce", b, 4, [OVERHEAD + b / W] * 5) for b in sizes]
    fit = cm.fit_link_from_summaries(jobs)
    assert fit.overhead_s == pytest.approx(OVERHEAD, rel=1e-6) and fit.bandwidth_Bps == pytest.approx(W, rel=1e-6)
    jobs.append(summarize_collective("all_reduce", 2**20, 2, [OVERHEAD] * 5))
    with pytest.raises(ValueError, match="one link per"):
        cm.fit_link_from_summaries(jobs)


def test_bucket_curve_minimum_is_the_predicted_best():
    fit = cm.LinkFit(overhead_s=OVERHEAD, bandwidth_Bps=W, n_points=4, rel_rms=0.0)
    s = 37_266_432                                   # tiny's fp32 gradients
    curve = cm.bucket_curve(s, fit, points=2000)
    i = int(np.argmin(curve["exposed_ms"]))
    assert curve["bucket_mb"][i] == pytest.approx(curve["best_bucket_mb"], rel=0.01)
    assert curve["best_bucket_mb"] == pytest.approx(math.sqrt(s * OVERHEAD * W) / 2**20)
    assert min(curve["exposed_ms"]) >= curve["best_exposed_ms"] - 1e-12
