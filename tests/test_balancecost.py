"""balance_cost: the cost model fitted to multi-rank runs, its predicted balanced/random
ratios next to the measured ones, and the GPU default applied to the same plans."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clusterft.analysis.balancecost import balance_markdown, balance_table, fit_cost, plan_work
from clusterft.analysis.costmodel import CostModel


def test_plan_work_sums_the_slowest_rank_of_each_step() -> None:
    assert plan_work([[10, 30], [25, 5], [7, 7]]) == 30 + 25 + 7
    assert np.isnan(plan_work([])) and np.isnan(plan_work(None))


def test_fit_recovers_known_constants_and_needs_three_runs() -> None:
    rng = np.random.default_rng(0)
    work = rng.uniform(1e4, 1e5, 12)
    steps = rng.integers(10, 80, 12).astype(float)
    wall = 2e-5 * work + 0.03 * steps
    fit = fit_cost(work, steps, wall)
    assert fit["seconds_per_token"] == pytest.approx(2e-5, rel=1e-6)
    assert fit["step_overhead_s"] == pytest.approx(0.03, rel=1e-6)
    assert fit["rel_resid_sd"] == pytest.approx(0.0, abs=1e-9) and fit["n_runs"] == 12
    # multiplicative noise of sd s shows as a residual spread near s
    noisy = wall * (1 + 0.05 * rng.standard_normal(12))
    assert 0.02 < fit_cost(work, steps, noisy)["rel_resid_sd"] < 0.1
    short = fit_cost(work[:2], steps[:2], wall[:2])
    assert short["n_runs"] == 2 and np.isnan(short["seconds_per_token"])


def _runs(a: float, b: float, jitter: float) -> pd.DataFrame:
    """Two datasets x two methods x (random, balanced) at 2 ranks, walls from the model with
    a deterministic +-jitter; balanced plans carry 20% less work on `skewed`."""
    rows, k = [], 0
    for ds, cut in (("even", 1.0), ("skewed", 0.8)):
        for method, budget, steps, work in (("full", 1.0, 60, 60_000), ("cluster", 0.31, 20, 21_000)):
            for dist, w in (("random", work), ("balanced", work * cut)):
                k += 1
                wall = (a * w + b * steps) * (1 + jitter * (-1) ** k)
                rows.append({"dataset": ds, "model": "m", "gpus": 2, "method": method,
                             "budget": budget, "epochs": "1", "precision": "fp32", "seed": 0,
                             "distribution": dist, "wall_time_s": wall, "steps": steps,
                             "padded_work": w})
    # a one-rank run and an unpaired run never form a row
    rows.append({**rows[0], "gpus": 1})
    rows.append({**rows[0], "method": "random", "budget": 0.31})
    return pd.DataFrame(rows)


def test_balance_table_puts_prediction_next_to_measurement() -> None:
    a, b = 1e-4, 0.02
    bt = balance_table(_runs(a, b, 0.002))
    assert len(bt) == 4
    assert set(bt["dataset"]) == {"even", "skewed"} and set(bt["gpus"]) == {2}
    assert bt["seconds_per_token"].iloc[0] == pytest.approx(a, rel=0.05)
    row = bt[(bt["dataset"] == "skewed") & (bt["method"] == "full")].iloc[0]
    assert row["measured_ratio"] == pytest.approx(row["balanced_s"] / row["random_s"])
    expect = (a * 48_000 + b * 60) / (a * 60_000 + b * 60)
    assert row["predicted_ratio"] == pytest.approx(expect, rel=0.01)
    assert row["cpu_can_show"] and row["agrees"]
    even = bt[(bt["dataset"] == "even") & (bt["method"] == "full")].iloc[0]
    assert even["predicted_ratio"] == pytest.approx(1.0) and not even["cpu_can_show"]
    gpu = CostModel(9e-5, 0.05)
    g = balance_table(_runs(a, b, 0.002), gpu)
    row = g[(g["dataset"] == "skewed") & (g["method"] == "full")].iloc[0]
    assert row["gpu_predicted_ratio"] == pytest.approx((9e-5 * 48_000 + 0.05 * 60)
                                                       / (9e-5 * 60_000 + 0.05 * 60))


def test_noisy_runs_cannot_show_a_small_effect() -> None:
    bt = balance_table(_runs(1e-4, 0.02, 0.3))
    assert (bt["ratio_noise"] > 0.3).all()
    assert not bt["cpu_can_show"].any()


def test_markdown_states_the_model_and_handles_no_pairs() -> None:
    bt = balance_table(_runs(1e-4, 0.02, 0.002))
    md = balance_markdown(bt)
    assert "slowest rank" in md and "| skewed | m | 2 | full-1 |" in md and "Fits:" in md
    empty = balance_table(pd.DataFrame({"wall_time_s": [1.0], "padded_work": [1.0],
                                        "distribution": ["random"], "gpus": [1]}))
    assert empty.empty and "no pair" in balance_markdown(empty)
