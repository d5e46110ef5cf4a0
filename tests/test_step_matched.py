"""The step-matched arm: train.step_budget pool trains as many optimiser steps as full data,
and the sweep plans it (sweep.step_matched) beside the paper protocol's runs."""

from __future__ import annotations

import json
import math

import pytest

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.names import STEPS_SUFFIX, split_dist
from clusterft.plan.config import load_config, settings
from clusterft.plan.inputs import Inputs
from clusterft.plan.sweep import Sweep
from clusterft.stages.train import pool_steps, run_train, step_plan, train_config
from test_train import BASE_CFG, make_selection


def test_step_plan_cycles_and_cuts_the_last_pass():
    assert step_plan([5], 3) == [5, 5, 5]  # the paper's protocol: epochs passes
    assert step_plan([5], 3, steps=12) == [5, 5, 2]
    assert step_plan([4, 3], 1, steps=10) == [4, 3, 3]  # RS2 subsets cycle
    assert step_plan([5], 3, steps=15) == [5, 5, 5]
    with pytest.raises(InputError, match="step_budget"):
        step_plan([0], 3, steps=4)


def test_pool_steps_is_full_datas_step_count():
    cfg = train_config({"epochs": 3, "global_batch_size": 32})
    assert pool_steps(2000, cfg, 1) == 3 * math.ceil(2000 / 32) == pool_steps(2000, cfg, 2)
    with pytest.raises(InputError, match="step_budget"):
        train_config({"step_budget": "budget"})


def test_a_step_matched_run_trains_full_datas_steps(tmp_path, tiny_model_dir, tiny_pool,
                                                     tiny_pool_path):
    n_pool = len(tiny_pool)
    cfg = {**BASE_CFG, "epochs": 2, "batch_size": 4}
    runs = {}
    for name, n, budget in (("full", n_pool, "selection"), ("sub", 10, "selection"),
                            ("sub_steps", 10, "pool")):
        sel = make_selection(tmp_path / f"{name}.parquet", tiny_pool, n)
        runs[name] = run_train(tiny_model_dir, tiny_pool_path, sel, tmp_path / name,
                               tmp_path / f"{name}.json", "balanced", 0,
                               {**cfg, "step_budget": budget})
    full_steps = 2 * math.ceil(n_pool / 4)
    assert runs["full"]["steps"] == full_steps
    assert runs["sub"]["steps"] == 2 * math.ceil(10 / 4)  # the paper's protocol: fewer steps
    m = runs["sub_steps"]
    assert m["steps"] == full_steps and m["step_budget"] == "pool"
    assert m["epochs"] == math.ceil(full_steps / math.ceil(10 / 4))
    assert len(m["per_rank_tokens_per_step"]) == full_steps
    assert json.loads((tmp_path / "sub_steps.json").read_text())["steps"] == full_steps


def test_the_sweep_plans_the_arm_beside_the_paper_protocol():
    cfg = load_config("config/config.yaml")
    cfg["sweep"]["step_matched"] = {"methods": ["random", "oracle"], "models": ["small"],
                                    "datasets": [next(iter(cfg["datasets"]))]}
    plan = Sweep(settings(cfg))
    matched = [r for r in plan.accuracy_runs if split_dist(r["dist"])[1]]
    ds = cfg["sweep"]["step_matched"]["datasets"][0]
    assert {(r["dataset"], r["model"], r["method"], r["budget"]) for r in matched} == {
        (ds, "small", m, "0.31") for m in ("random", "oracle")}
    assert all(r["dist"] == "balanced" + STEPS_SUFFIX for r in matched)
    assert {plan.run_role(r, True) for r in matched} == {"step_matched"}
    jobs_cfg = Inputs(cfg, plan)
    for r in matched:  # trained with step_budget pool, dealt with the accuracy distribution
        assert json.loads(jobs_cfg.run_train_cfg(r))["step_budget"] == "pool"
        assert jobs_cfg.train_distribution(r) == "balanced"
    plain_run = next(r for r in plan.accuracy_runs if not split_dist(r["dist"])[1])
    assert json.loads(jobs_cfg.run_train_cfg(plain_run)).get("step_budget", "selection") == "selection"
    # the same selections as the paper protocol's runs: no extra select job
    jobs = plan.jobs()
    selects = [j for j in jobs if j["rule"] == "select"]
    plain = Sweep(settings(load_config("config/config.yaml"))).jobs()
    assert len(selects) == len([j for j in plain if j["rule"] == "select"])
