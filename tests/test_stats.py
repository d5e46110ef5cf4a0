"""clusterft.analysis.stats: mean +- t CI over seeds, the paired two-level bootstrap of a macro-average
difference, and the minimum detectable difference; checked against scipy, exact cases and a
simulation where the truth is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from clusterft.analysis.stats import mean_ci, minimum_detectable_difference, paired_comparison, power_line


# ---------------------------------------------------------------- mean_ci

def test_mean_ci_matches_scipy_t_interval():
    x = np.array([0.61, 0.64, 0.58, 0.66])
    mean, half, n = mean_ci(x)
    lo, hi = sps.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    assert n == 4
    assert mean == pytest.approx(x.mean())
    assert half == pytest.approx((hi - lo) / 2)
    _, half90, _ = mean_ci(x, level=0.90)
    lo90, hi90 = sps.t.interval(0.90, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    assert half90 == pytest.approx((hi90 - lo90) / 2)


def test_mean_ci_single_nan_and_empty():
    mean, half, n = mean_ci([0.7])
    assert (mean, n) == (0.7, 1) and math.isnan(half)
    mean, half, n = mean_ci([0.5, float("nan"), 0.7])
    assert n == 2 and mean == pytest.approx(0.6)
    assert half == pytest.approx(sps.t.ppf(0.975, 1) * np.std([0.5, 0.7], ddof=1) / math.sqrt(2))
    mean, half, n = mean_ci([])
    assert n == 0 and math.isnan(mean) and math.isnan(half)
    assert mean_ci([float("nan")])[2] == 0


# ---------------------------------------------------------------- paired_comparison: exact cases

def _bernoulli(rng, shape, p=0.5):
    return (rng.random(shape) < p).astype(float)


def test_identical_methods_give_zero_and_p_one():
    rng = np.random.default_rng(0)
    a = _bernoulli(rng, (3, 300))
    tasks = np.repeat(["arc", "hellaswag", "piqa"], 100)
    r = paired_comparison(a, a.copy(), tasks, n_boot=500)
    assert r["diff"] == 0.0
    assert r["ci_low"] <= 0.0 <= r["ci_high"]
    assert r["p"] == 1.0
    assert r["se"] == 0.0 and r["mde"] == 0.0
    assert (r["n_seeds"], r["n_items"], r["n_tasks"]) == (3, 300, 3)


def test_constant_shift_is_recovered_exactly():
    rng = np.random.default_rng(1)
    b = rng.random((3, 240))
    a = b + 0.2
    tasks = np.repeat(["t1", "t2"], [40, 200])
    r = paired_comparison(a, b, tasks, n_boot=300)
    assert r["diff"] == pytest.approx(0.2, abs=1e-12)
    assert r["ci_low"] == pytest.approx(0.2, abs=1e-9)
    assert r["ci_high"] == pytest.approx(0.2, abs=1e-9)
    assert r["se"] < 1e-9
    assert r["p"] == pytest.approx(1 / 301)  # every replicate > 0: the smallest p n_boot can give


def test_macro_average_weighs_tasks_equally():
    # Task "small" (10 items): A right, B wrong everywhere (d = 1). Task "big" (90 items): d = 0.
    # Micro average over items would be 0.1; the macro average over tasks is 0.5.
    n_small, n_big = 10, 90
    tasks = np.array(["big"] * n_big + ["small"] * n_small)
    np.random.default_rng(2).shuffle(tasks)  # tasks interleaved, not contiguous
    b = np.zeros((2, n_small + n_big))
    a = (tasks == "small").astype(float)[None, :].repeat(2, axis=0)
    r = paired_comparison(a, b, tasks, n_boot=200)
    assert r["diff"] == pytest.approx(0.5)
    assert (a - b).mean() == pytest.approx(0.1)  # the micro value it must not return
    assert r["n_tasks"] == 2
    # Task sizes are kept when items are resampled within a task, so every replicate is 0.5.
    assert r["ci_low"] == pytest.approx(0.5) and r["ci_high"] == pytest.approx(0.5)


def test_deterministic_in_seed_and_p_agrees_with_ci():
    rng = np.random.default_rng(3)
    a = _bernoulli(rng, (3, 400), 0.55)
    b = _bernoulli(rng, (3, 400), 0.5)
    tasks = np.repeat([0, 1, 2, 3], 100)
    r1 = paired_comparison(a, b, tasks, seed=7)
    assert r1 == paired_comparison(a, b, tasks, seed=7)
    assert r1 != paired_comparison(a, b, tasks, seed=8)
    for shift in (0.0, 0.03, 0.06, 0.1):
        r = paired_comparison(a + shift, b, tasks, n_boot=1000, seed=1)
        outside = not (r["ci_low"] <= 0.0 <= r["ci_high"])
        # The p rule and the percentile CI reject together (up to the quantile interpolation).
        assert (r["p"] < 0.05) == outside or abs(r["p"] - 0.05) < 0.005, r


def test_min_se_floor_enters_se_and_mde():
    rng = np.random.default_rng(4)
    b = rng.random((2, 50))
    r = paired_comparison(b + 0.1, b, np.zeros(50, int), n_boot=100, min_se=0.01)
    assert r["se"] == 0.01
    assert r["mde"] == pytest.approx(minimum_detectable_difference(0.01))
    assert r["ci_high"] - r["ci_low"] < 1e-9  # the floor does not widen the bootstrap CI


def test_single_seed_runs_on_items_only():
    rng = np.random.default_rng(5)
    a, b = _bernoulli(rng, (1, 500)), _bernoulli(rng, (1, 500))
    r = paired_comparison(a, b, np.zeros(500, int), n_boot=2000)
    d = (a - b).ravel()
    # One task, one seed: the ordinary bootstrap of a mean, se ~ sd / sqrt(n).
    assert r["se"] == pytest.approx(d.std() / math.sqrt(500), rel=0.1)


@pytest.mark.parametrize("a_shape,b_shape,n_tasks,match", [
    ((3, 10), (3, 9), 10, "same shape"),
    ((3, 10), (2, 10), 10, "same shape"),
    ((10,), (10,), 10, "2-D"),
    ((3, 10), (3, 10), 9, "one entry per item"),
    ((0, 10), (0, 10), 10, "empty"),
    ((3, 0), (3, 0), 0, "empty"),
])
def test_bad_shapes_raise(a_shape, b_shape, n_tasks, match):
    with pytest.raises(ValueError, match=match):
        paired_comparison(np.zeros(a_shape), np.zeros(b_shape), np.zeros(n_tasks, int))


def test_non_finite_scores_raise():
    a = np.zeros((2, 5))
    a[1, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        paired_comparison(a, np.zeros((2, 5)), np.zeros(5, int))


# ---------------------------------------------------------------- simulation with a known truth

S, T, N_PER_TASK, RUN_SD, P = 3, 3, 200, 0.02, 0.5
N_SIM, N_BOOT = 200, 400


def _rejection_rate(delta: float, sim_seed: int) -> tuple[float, float]:
    """Rate of p < 0.05 over N_SIM simulated designs, and the mean reported se.

    Each method's run s has its own run effect ~ N(0, RUN_SD) (a whole selection + training
    run), each item is a Bernoulli draw; A's accuracy is shifted by delta."""
    rng = np.random.default_rng(sim_seed)
    tasks = np.repeat(np.arange(T), N_PER_TASK)
    rejections, ses = 0, []
    for k in range(N_SIM):
        run_a = rng.normal(0.0, RUN_SD, (S, 1))
        run_b = rng.normal(0.0, RUN_SD, (S, 1))
        a = (rng.random((S, T * N_PER_TASK)) < P + delta + run_a).astype(float)
        b = (rng.random((S, T * N_PER_TASK)) < P + run_b).astype(float)
        r = paired_comparison(a, b, tasks, n_boot=N_BOOT, seed=k)
        rejections += r["p"] < 0.05
        ses.append(r["se"])
    return rejections / N_SIM, float(np.mean(ses))


# True SE of the estimated difference: run effects of both methods averaged over S seeds, plus
# item noise var(a - b) = 2 p (1 - p) averaged over all S * T * N cells.
ITEM_VAR = 2 * P * (1 - P)
N_CELLS = S * T * N_PER_TASK
SE_TRUE = math.sqrt(2 * RUN_SD**2 / S + ITEM_VAR / N_CELLS)
# Expected bootstrap SE of the crossed (seeds x items) bootstrap: the seed level keeps
# (S - 1) / S of the run variance, and the seed x item noise is counted E[c^2] E[k^2] - 1 =
# (2 - 1/S)(2 - 1/n_t) - 1 times (c, k: multinomial resampling counts) instead of once.
SE_BOOT = math.sqrt((1 - 1 / S) * 2 * RUN_SD**2 / S
                    + ((2 - 1 / S) * (2 - 1 / N_PER_TASK) - 1) * ITEM_VAR / N_CELLS)


def _power(delta: float, se_test: float) -> float:
    """Normal-approximation power of |diff| / se_test > 1.96 when diff ~ N(delta, SE_TRUE)."""
    z = sps.norm.ppf(0.975)
    return float(sps.norm.sf((z * se_test - delta) / SE_TRUE)
                 + sps.norm.cdf((-z * se_test - delta) / SE_TRUE))


def test_simulation_null_rejection_rate_and_se():
    rate, mean_se = _rejection_rate(0.0, sim_seed=10)
    # Nominal 0.05; 0.10 leaves > 3 binomial SDs (sd = 0.015 at 200 simulations).
    assert rate <= 0.10, rate
    # The reported se is the crossed bootstrap's: conservative here (item noise dominates).
    assert mean_se == pytest.approx(SE_BOOT, rel=0.10)
    assert mean_se > SE_TRUE


def test_simulation_power_at_the_mde():
    mde_true = minimum_detectable_difference(SE_TRUE)
    rate, _ = _rejection_rate(mde_true, sim_seed=11)
    # At the MDE of the true SE an exact test would reject 80% of the time; the crossed
    # bootstrap's conservative se lowers that to _power(mde_true, SE_BOOT) (about 0.65). Allow
    # 0.12 around it: > 3 binomial SDs (sd ~0.034 at 200 simulations) plus the normal approx.
    expected = _power(mde_true, SE_BOOT)
    assert 0.55 <= expected <= 0.75
    assert abs(rate - expected) <= 0.12, (rate, expected)

    # The MDE the report prints (from the reported se) is honest: a true difference that size
    # is detected at least about 80% of the time.
    mde_reported = minimum_detectable_difference(SE_BOOT)
    rate_reported, _ = _rejection_rate(mde_reported, sim_seed=12)
    assert rate_reported >= 0.72, rate_reported  # nominal 0.8 - 2.5 binomial SDs (~0.028)


# ---------------------------------------------------------------- MDE and the power line

def test_minimum_detectable_difference():
    assert minimum_detectable_difference(1.0) == pytest.approx(2.8016, abs=1e-4)
    assert minimum_detectable_difference(0.01) == pytest.approx(0.028016, abs=1e-6)
    assert minimum_detectable_difference(1.0, alpha=0.01, power=0.9) == pytest.approx(
        sps.norm.ppf(0.995) + sps.norm.ppf(0.9))
    with pytest.raises(ValueError):
        minimum_detectable_difference(1.0, alpha=0.0)


def test_power_line_clears_or_not():
    line = power_line(0.01, observed=0.05)
    assert line["mde"] == pytest.approx(0.028016, abs=1e-6) and line["clears"] is True
    assert power_line(0.01, observed=-0.05)["clears"] is True  # either direction
    assert power_line(0.01, observed=0.02)["clears"] is False


def test_cluster_agreement_matches_scikit_learn_on_a_constructed_case():
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    from clusterft.analysis.stats import cluster_agreement

    truth = np.array(["a"] * 6 + ["b"] * 4 + ["c"] * 2)
    clusters = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    got = cluster_agreement(clusters, truth)
    assert got["ari"] == pytest.approx(adjusted_rand_score(truth, clusters))
    assert got["nmi"] == pytest.approx(normalized_mutual_info_score(truth, clusters))
    # cluster 0: 4 a; cluster 1: 2 a + 3 b; cluster 2: 1 b + 2 c -> purity (4 + 3 + 2) / 12
    assert got["purity"] == pytest.approx(9 / 12)
    assert got["label_coverage"] == pytest.approx(1.0)  # a, b, c each own a cluster
    merged = cluster_agreement(np.zeros(12, dtype=int), truth)
    assert merged["label_coverage"] == pytest.approx(1 / 3) and merged["ari"] == pytest.approx(0)


def test_one_sided_mde_and_bounds():
    """The non-inferiority power line: (z_0.95 + z_0.8) * se; the one-sided bounds are the
    5% and 95% bootstrap quantiles, inside the two-sided 95% interval."""
    assert minimum_detectable_difference(1.0, one_sided=True) == pytest.approx(2.4865, abs=1e-4)
    rng = np.random.default_rng(6)
    a, b = _bernoulli(rng, (3, 300), 0.6), _bernoulli(rng, (3, 300), 0.5)
    r = paired_comparison(a, b, np.repeat([0, 1, 2], 100), n_boot=1000)
    assert r["ci_low"] < r["ci_low_1s"] < r["diff"] < r["ci_high_1s"] < r["ci_high"]


def test_gain_share_recovers_a_known_share():
    """a halfway between b and c on every item: the share is 0.5, with an interval around
    it from the joint bootstrap; a non-positive denominator gives no share."""
    from clusterft.analysis.stats import gain_share

    rng = np.random.default_rng(7)
    b = rng.random((3, 400)) * 0.5
    c = b + 0.2 + rng.normal(0, 0.05, (3, 400))
    a = b + 0.1 + rng.normal(0, 0.05, (3, 400))
    tasks = np.repeat([0, 1], 200)
    g = gain_share(a, b, c, tasks, n_boot=500)
    assert g["share"] == pytest.approx(0.5, abs=0.05)
    assert g["ci_low"] < g["share"] < g["ci_high"] and g["ci_high"] - g["ci_low"] < 0.2
    assert g["n_dropped"] == 0
    assert math.isnan(gain_share(a, b, b - 0.1, tasks, n_boot=50)["share"])
