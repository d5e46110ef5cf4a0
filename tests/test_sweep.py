"""The sweep as Python (`clusterft.plan.sweep`, `clusterft.plan.inputs`): runs per kind,
their paths and the report's records on small config dicts, the rules' input functions,
and the job list against `snakemake -n -F` on the shipped configs and a few variants."""

from __future__ import annotations

import collections
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterft.plan.config import settings
from clusterft.plan.inputs import Inputs
from clusterft.plan.sweep import RUN, Sweep, run_path, selection_path
from clusterft.tools.cost import parse_dry_run

ROOT = Path(__file__).resolve().parents[1]


def small(**sweep) -> dict:
    """Two datasets, two models, two seeds; methods full, random and cluster at two
    budgets on 1 GPU; the time sweep: cluster at 0.5 on 2 and 4 GPUs, both distributions."""
    cfg = {
        "seeds": [0, 1],
        "datasets": {"skills": {"domain": "programming", "source": "skills", "n": 100},
                     "icd10": {"domain": "medicine", "source": "icd10", "n": 100}},
        "models": {"a": {"source": "build"}, "b": {"source": "build"}},
        "cluster": {"k": 4},
        "sweep": {"methods": ["full", "random", "cluster"], "budgets": [0.25, 0.5],
                  "accuracy": {"gpus": 1, "distribution": "balanced"},
                  "time": {"methods": ["cluster"], "budgets": [0.5], "gpus": [2, 4],
                           "distributions": ["random", "balanced"], "seeds": [0]}},
    }
    cfg["sweep"].update(copy.deepcopy(sweep))
    return cfg


def count(runs, **where) -> int:
    return sum(all(r[k] == v for k, v in where.items()) for r in runs)


def test_accuracy_and_time_runs_of_a_small_config() -> None:
    plan = Sweep(small())
    acc, time = plan.accuracy_runs, plan.time_runs
    # 2 datasets x 2 models x 2 seeds x (full at 1 + random and cluster at 2 budgets)
    assert len(acc) == 2 * 2 * 2 * (1 + 2 * 2)
    assert count(acc, method="full") == 8 and {r["budget"] for r in acc} == {"0.25", "0.5", "1"}
    assert {r["gpus"] for r in acc} == {1} and {r["dist"] for r in acc} == {"balanced"}
    # 2 datasets x 2 models x 1 seed x 2 GPU counts x 2 distributions x (full + cluster)
    assert len(time) == 2 * 2 * 1 * 2 * 2 * 2
    assert count(time, method="full", budget="1") == 16
    assert not any(plan.is_accuracy(r) for r in time)
    assert len(plan.runs) == len(acc) + len(time)


def test_optional_groups_add_runs_on_their_models_only() -> None:
    plan = Sweep(small(curve={"methods": ["cluster"], "budgets": [0.1, 0.5], "models": ["a"]},
                       baselines={"methods": ["s2l"], "models": ["b"]},
                       distribution_ablation={"methods": ["random"], "distribution": "random"}))
    acc = plan.accuracy_runs
    # the curve's extra budget (0.5 is a sweep budget already) on model a only
    assert count(acc, method="cluster", budget="0.1") == 2 * 2  # 2 datasets x 2 seeds
    assert count(acc, method="cluster", budget="0.1", model="b") == 0
    # the baseline at the sweep budgets on model b only
    assert count(acc, method="s2l") == 2 * 2 * 2 and count(acc, method="s2l", model="a") == 0
    # the ablation: random with the other distribution at the sweep budgets, every model
    assert count(acc, method="random", dist="random") == 2 * 2 * 2 * 2
    roles = collections.Counter(r.get("role") for r in plan.run_records())
    assert roles["ablation"] == 16 and roles["time"] == len(plan.time_runs)
    assert roles[None] == 4  # each base model's evaluation, per dataset


def test_a_time_run_equal_to_an_accuracy_run_is_one_run() -> None:
    cfg = small()
    cfg["sweep"]["time"].update(gpus=[1], distributions=["balanced"])
    plan = Sweep(cfg)
    assert all(plan.is_accuracy(r) for r in plan.time_runs)
    assert len(plan.runs) == len(plan.accuracy_runs)
    assert not any(r.get("role") == "time" for r in plan.run_records())


def test_time_models_restrict_the_time_runs() -> None:
    cfg = small()
    cfg["sweep"]["time"]["models"] = ["b"]
    assert {r["model"] for r in Sweep(cfg).time_runs} == {"b"}


def test_paths_and_report_inputs() -> None:
    plan = Sweep(small())
    run = dict(dataset="skills", model="a", method="cluster", budget="0.5", gpus=1,
               dist="balanced", seed=1)
    assert RUN.format(**run) == "skills/a/cluster-0.5/g1-balanced/s1"
    assert run_path("eval", run, "results.json") == \
        "results/eval/skills/a/cluster-0.5/g1-balanced/s1/results.json"
    assert selection_path(run) == "results/select/skills/a/cluster-0.5/s1/selection.parquet"
    inputs = plan.report_inputs()
    assert len(inputs["evals"]) == len(inputs["per_item"]) == len(plan.accuracy_runs)
    assert len(inputs["metrics"]) == len(plan.runs)
    assert len(inputs["base_evals"]) == 4 and len(inputs["labels"]) == 2
    assert len(inputs["clusters"]) == 2 * 2 * 2 * 4  # datasets x models x seeds x kinds
    assert not any("/full-1/" in s for s in inputs["selections"])
    assert "results/plots/time_icd10.png" in plan.report_outputs()
    # the overhead benchmarks: cluster at the claim budget beside full data
    bench = plan.overhead_benchmarks("cluster", 0.5)
    assert "benchmarks/out/train/skills/a/cluster-0.5/g1-balanced/s0.tsv" in bench
    assert "benchmarks/out/train/skills/a/full-1/g1-balanced/s0.tsv" in bench
    assert "benchmarks/out/select/skills/a/cluster-0.5/s0.tsv" in bench


def test_fused_seeds_share_one_train_and_evaluate_job() -> None:
    cfg = small()
    cfg["sweep"]["accuracy"]["fuse_seeds"] = True
    plan = Sweep(cfg)
    run = plan.accuracy_runs[0]
    assert plan.fused(run) and plan.train_benchmark(run).endswith("/s0+1.tsv")
    rules = collections.Counter(j["rule"] for j in plan.jobs())
    assert rules["train_seeds"] == rules["evaluate_seeds"] == len(plan.accuracy_runs) // 2
    assert rules["train"] == len(plan.time_runs)  # the time runs (2 or 4 GPUs) stay apart
    assert "evaluate" not in rules


def test_defaults_come_from_the_stage_modules() -> None:
    from clusterft.stages import evaluate, score, train
    from clusterft.stages.data import decontaminate

    cfg = settings(small())
    assert cfg["train"]["device"] == train.DEFAULTS["device"] == "auto"
    assert cfg["score"]["shards"] == score.DEFAULTS["shards"]
    assert cfg["evaluate"]["shards"] == evaluate.DEFAULTS["shards"]
    assert cfg["tasks"]["decontaminate"] == decontaminate.DEFAULTS["action"]
    assert cfg["tasks"]["max_overlap"] == decontaminate.DEFAULTS["max_overlap"]
    assert cfg["model_train"]["a"]["epochs"] == train.DEFAULTS["epochs"]
    assert cfg["sweep"]["accuracy"]["fuse_seeds"] is False


def test_input_functions() -> None:
    cfg = small(methods=["full", "rs2", "less", "oracle"])
    cfg["score"] = {"shards": 3}
    cfg["train"] = {"epochs": 2}
    cfg["sweep"]["time"]["epochs"] = 1
    plan = Sweep(cfg)
    jobs = Inputs(cfg, plan)
    w = {"dataset": "skills", "model": "a", "budget": "0.5", "seed": "0"}
    less = jobs.select_inputs({**w, "method": "less"})
    assert less["clusters"] == "results/cluster/skills/a/gradient/s0/clusters.parquet"
    assert less["targets"] == "results/score/skills/a/s0/targets.npy"
    assert "labels" in jobs.select_inputs({**w, "method": "oracle"})
    assert jobs.select_epochs({**w, "method": "rs2"}) == 2
    assert jobs.select_epochs({**w, "method": "full"}) == 1
    score = jobs.score_inputs(w)
    assert score["warmup"] == "results/score/skills/a/s0/warmup.safetensors"
    assert len(score["shards"]) == 3
    assert "shards" not in jobs.score_warmup_cfg(w)
    run = {**w, "method": "full", "budget": "1", "dist": "balanced"}
    assert jobs.train_cfg({**run, "gpus": "1"}) == '{"epochs": 2}'  # an accuracy run
    assert jobs.train_cfg({**run, "gpus": "4"}) == '{"epochs": 1, "keep_model": false}'  # time-only
    assert jobs.train_job({**run, "gpus": "4"})["ranks_per_node"] == 4
    assert jobs.dataset_cfg(w)["items_per_task"] == 200
    assert jobs.decontaminate_cfg(w) == {"action": "drop", "max_overlap": 0}


def test_a_dataset_train_section_overrides_its_runs_epochs_and_lr() -> None:
    """datasets.<name>.train (epochs, lr) is merged over the model's train section for every
    run of that dataset, and only its: train settings and params, RS2's per-epoch subsets,
    the train priority (relative to its own dataset's longest run); the data and download
    jobs' params leave it out (no rerun of the data for a changed epoch count)."""
    import json

    cfg = small(methods=["full", "rs2"])
    cfg["train"] = {"epochs": 3}
    cfg["models"]["b"]["train"] = {"lr": 0.01}
    cfg["datasets"]["icd10"]["train"] = {"epochs": 20}
    plan = Sweep(cfg)
    jobs = Inputs(cfg, plan)
    assert plan.runs and {r["dataset"] for r in plan.runs} == {"skills", "icd10"}
    for r in plan.runs:
        want = 20 if r["dataset"] == "icd10" else 3
        settings_, params = plan.train_settings(r), json.loads(jobs.run_train_cfg(r))
        assert settings_["epochs"] == params["epochs"] == want, r
        if r["model"] == "b":  # the model's own lr still applies on both datasets
            assert settings_["lr"] == params["lr"] == 0.01
    for d, want in (("icd10", 20), ("skills", 3)):
        w = {"dataset": d, "model": "a", "budget": "0.5", "seed": "0"}
        assert jobs.select_epochs({**w, "method": "rs2"}) == want
        assert jobs.select_epochs({**w, "method": "full"}) == 1
        assert "train" not in jobs.dataset_cfg(w)
    # each dataset's full-data run is its own longest: the same priority, 20 epochs or 3
    full = {"model": "a", "method": "full", "budget": "1", "gpus": "1", "dist": "balanced",
            "seed": "0"}
    assert jobs.train_priority({**full, "dataset": "icd10"}) == jobs.train_priority(
        {**full, "dataset": "skills"}) == 50  # one of two seeds
    assert all("train" not in spec for spec in jobs.download_params["datasets"].values())
    # the dataset's lr over the model's; sweep.time.epochs still sets the time-only runs'
    cfg["datasets"]["icd10"]["train"] = {"epochs": 20, "lr": 5.0e-4}
    cfg["sweep"]["time"]["epochs"] = 1
    plan = Sweep(cfg)
    jobs = Inputs(cfg, plan)
    for r in plan.runs:
        settings_, params = plan.train_settings(r), json.loads(jobs.run_train_cfg(r))
        epochs = 1 if plan.is_time_only(r) else 20 if r["dataset"] == "icd10" else 3
        lr = 5.0e-4 if r["dataset"] == "icd10" else 0.01 if r["model"] == "b" else None
        assert settings_["epochs"] == params["epochs"] == epochs, r
        assert params.get("lr") == lr and settings_["lr"] == (lr or settings_["lr"]), r


def test_runs_that_are_only_timed_keep_no_model_and_nothing_reads_it() -> None:
    """Time-only runs train with keep_model: false (their folder: NOT_KEPT.json only), the
    accuracy runs' settings are untouched (the same params, so no reruns), and no job of the
    DAG takes a time-only run's model: only the evaluate rules read a run's model, and
    they evaluate accuracy runs only. Also on the shipped configs."""
    import json

    rules = {p.name: p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk")}
    readers = {name for name, text in rules.items() if "train/{RUN}/model" in text}
    assert readers == {"train.smk", "evaluate.smk"}  # train writes it, evaluate reads it
    for cfg in (small(), yaml.safe_load((ROOT / "config" / "config.yaml").read_text()),
                yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())):
        plan = Sweep(cfg)
        jobs = Inputs(cfg, plan)
        timed = [r for r in plan.runs if plan.is_time_only(r)]
        assert timed
        for r in plan.runs:
            settings_ = plan.train_settings(r)
            params = json.loads(jobs.run_train_cfg(r))
            if plan.is_time_only(r):
                assert settings_["keep_model"] is False and params["keep_model"] is False
            else:
                assert settings_["keep_model"] is True and "keep_model" not in params
        for j in plan.jobs():
            if j["rule"].startswith("evaluate") and "method" in j["wildcards"]:
                run = {**j["wildcards"], "seed": j["wildcards"].get("seed", plan.seeds[0])}
                assert plan.is_accuracy(run), j
    embedded = Sweep(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    assert sum(j["rule"] == "train" and embedded.is_time_only(j["wildcards"])
               for j in embedded.jobs()) == 8  # 2 and 4 GPUs x 2 distributions x 2 runs (pycode)
    paper = Sweep(yaml.safe_load((ROOT / "config" / "paper.yaml").read_text()))
    train = [j for j in paper.jobs() if j["rule"] == "train"]
    assert (len(train), sum(paper.is_time_only(j["wildcards"]) for j in train)) == (432, 54)  # 72 of them LESS and RDS+ (7B)


def test_keep_model_false_in_a_config_is_refused() -> None:
    from clusterft.pipeline.errors import InputError
    from clusterft.plan.config import prepare

    for where in ("train", "model"):
        cfg = small()
        if where == "train":
            cfg["train"] = {"keep_model": False}
        else:
            cfg["models"]["b"]["train"] = {"keep_model": False}
        with pytest.raises(InputError, match="keep_model: false"):
            prepare(cfg)


def test_the_sweep_module_runs_without_snakemake() -> None:
    code = ("import sys; import clusterft.plan.sweep, clusterft.plan.inputs; "
            "print(sorted(m for m in ('snakemake', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def variants(tmp_path: Path) -> list[Path]:
    """The shipped configs, and the smoke config with sharded scoring and evaluation,
    unfused seeds, baselines, time epochs and time seeds beyond the config's; then fused
    seeds with one-GPU time runs (trained by the fused jobs too)."""
    shipped = [ROOT / ".test" / "config.yaml", ROOT / "config" / "config.yaml",
               ROOT / "config" / "paper.yaml"]
    cfg = yaml.safe_load(shipped[0].read_text(encoding="utf-8"))
    cfg["score"]["shards"] = 2
    cfg["evaluate"]["shards"] = 2
    cfg["seeds"] = [0, 1]
    cfg["sweep"]["accuracy"]["fuse_seeds"] = False
    cfg["sweep"]["methods"] = ["full", "random", "cluster"]
    cfg["sweep"]["baselines"] = {"methods": ["s2l", "less"]}
    cfg["sweep"]["step_matched"] = {"methods": ["random"], "datasets": ["cipher"]}
    cfg["sweep"]["time"].update(methods=["cluster", "rs2"], epochs=1, seeds=[0, 3])
    sharded = tmp_path / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    cfg["score"]["shards"] = 1
    cfg["evaluate"]["shards"] = 1
    cfg["seeds"] = [0]
    cfg["sweep"]["accuracy"]["fuse_seeds"] = True
    cfg["sweep"]["time"].update(gpus=[1, 2], distributions=["random"], epochs=None)
    fused = tmp_path / "fused.yaml"
    fused.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return shipped + [sharded, fused]


def test_jobs_are_those_of_the_dry_run(tmp_path: Path) -> None:
    """Every job (rule and wildcards) of `snakemake -n -F`, no more and no fewer."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for config in variants(tmp_path):
        out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-F", "--configfile",
                              str(config)], capture_output=True, text=True, cwd=ROOT,
                             env=env, timeout=600)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        dag = parse_dry_run(out.stdout + "\n" + out.stderr)
        cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
        mine = Sweep(cfg).jobs()

        def jobset(jobs):
            return collections.Counter((j["rule"], tuple(j["wildcards"].items())) for j in jobs)

        assert jobset(mine) == jobset(dag), config.name
        # the train and evaluate outputs: the runs' own paths
        plan = Sweep(cfg)
        trained = {f"results/train/{RUN.format(**r)}/train_metrics.json" for r in plan.runs}
        printed = {p for line in (out.stdout + out.stderr).splitlines()
                   if line.strip().startswith("output:")
                   for p in line.split(":", 1)[1].replace(" ", "").split(",")}
        assert trained <= printed, config.name
        assert {run_path("eval", r, "results.json") for r in plan.accuracy_runs} <= printed
        assert not {p for p in printed if p.endswith("train_metrics.json")} - trained


# ------------------------------------------------------------------ the quick target

def quick_config(**quick) -> dict:
    """small() with a testbed (cipher, on model b only) and the oracle as a baseline."""
    cfg = small(baselines={"methods": ["oracle"]})
    cfg["datasets"]["cipher"] = {"domain": "programming", "source": "cipher", "n": 200,
                                 "n_skills": 4, "n_words": 6, "words_per_example": 3,
                                 "items_per_skill": 10, "held_out": 30, "models": ["b"]}
    cfg["sweep"]["methods"] = ["full", "random", "cluster"]
    if quick:
        cfg["sweep"]["quick"] = quick
    return cfg


def test_quick_is_one_cell_of_the_same_runs() -> None:
    plan = Sweep({**quick_config(), "report": {"claim_budget": 0.5}})
    q = plan.quick()
    # the testbed is chosen (not the first dataset), on its first (only) model
    assert plan.quick_cell() == ("cipher", "b") and q.cells == [("cipher", "b")]
    # full at 1, random, oracle and cluster at the claim budget
    keys = {plan.key(r) for r in plan.runs}
    assert {(r["method"], r["budget"]) for r in q.accuracy_runs} == {
        ("full", "1"), ("random", "0.5"), ("oracle", "0.5"), ("cluster", "0.5")}
    assert len(q.accuracy_runs) == 4 * 2  # x 2 seeds
    assert all(plan.key(r) in keys for r in q.runs) and q.time_runs == []
    inputs = q.report_inputs()
    whole = plan.report_inputs()
    for name, paths in inputs.items():  # the same files the whole report reads
        assert set(paths) <= set(whole[name]), name
    assert len(inputs["clusters"]) == 2 * 4  # seeds x feature kinds, one cell
    records = q.run_records()
    assert {(r["dataset"], r["model"]) for r in records} == {("cipher", "b")}
    assert {r["method"] for r in records} == {"full", "random", "oracle", "cluster", "base"}
    # the whole plan is untouched by the view
    assert len(plan.cells) == 5 and len(plan.accuracy_runs) > len(q.accuracy_runs)


def test_quick_settings_and_their_errors() -> None:
    from clusterft.pipeline.errors import InputError

    cfg = {**quick_config(dataset="icd10", model="a", methods=["full", "cluster"]),
           "report": {"claim_budget": 0.25}}
    q = Sweep(cfg).quick()
    assert {(r["dataset"], r["model"], r["method"]) for r in q.accuracy_runs} == {
        ("icd10", "a", "full"), ("icd10", "a", "cluster")}
    # the oracle is a baseline of every cell here, but rs2 is run nowhere
    with pytest.raises(InputError) as e:
        Sweep({**quick_config(methods=["full", "rs2"]), "report": {"claim_budget": 0.25}}).quick()
    assert e.value.field == "sweep.quick.methods" and "rs2" in str(e.value)
    # the claim budget must be one of the sweep's budgets
    with pytest.raises(InputError) as e:
        Sweep({**quick_config(), "report": {"claim_budget": 0.31}}).quick()
    assert e.value.field == "report.claim_budget" and "0.31" in str(e.value)
    # a model the dataset does not run on
    with pytest.raises(InputError) as e:
        Sweep(quick_config(model="a")).quick_cell()
    assert e.value.field == "sweep.quick.model"
    # no testbed: the first dataset
    cfg = small(baselines={"methods": ["oracle"]})
    assert Sweep(cfg).quick_cell() == ("skills", "a")
    # the default methods: those of full, random, oracle and cluster the cell runs (a sweep
    # without the oracle, as on pools without labels, runs the other three) ...
    q = Sweep({**small(), "report": {"claim_budget": 0.5}}).quick()
    assert {r["method"] for r in q.accuracy_runs} == {"full", "random", "cluster"}
    # ... but full data and the method at least
    cfg = {**small(), "report": {"claim_budget": 0.5}}
    cfg["sweep"]["methods"] = ["full", "random"]
    with pytest.raises(InputError) as e:
        Sweep(cfg).quick()
    assert e.value.field == "sweep.quick.methods" and "cluster" in str(e.value)


def test_quick_names_an_undefined_dataset_at_the_config_check() -> None:
    from clusterft.plan.config import check_config

    cfg = settings(quick_config(dataset="nope"))
    with pytest.raises(Exception) as e:
        check_config(cfg, "c.yaml")
    assert "sweep.quick.dataset" in str(e.value) and "nope" in str(e.value)


def test_train_priority_starts_the_longest_runs_first() -> None:
    """Longest-processing-time first: a job's priority is its expected work (share of full
    data's steps x epochs x seeds in the job x model cost) in percent of the longest kind."""
    from types import SimpleNamespace

    cfg = small(step_matched={"methods": ["random"]})
    cfg["models"] = {"a": {"source": "build", "size": {"hidden_size": 64,
                                                        "num_hidden_layers": 2}},
                     "b": {"source": "build", "size": {"hidden_size": 128,
                                                        "num_hidden_layers": 2}}}
    cfg["train"] = {"epochs": 3}
    cfg["sweep"]["time"]["epochs"] = 1
    jobs = Inputs({}, Sweep(cfg))

    def prio(method, budget, dist, model="b", gpus="1", seed="0"):
        w = dict(dataset="skills", model=model, method=method, budget=budget, gpus=gpus,
                 dist=dist)
        if seed is not None:
            w["seed"] = seed
        return jobs.train_priority(SimpleNamespace(**w))

    # a fused job (no seed wildcard: both seeds) of full data on the costlier model: 100
    assert prio("full", "1", "balanced", seed=None) == prio("random", "0.5", "balanced_steps",
                                                           seed=None) == 100
    assert prio("full", "1", "balanced") == 50  # one of the two seeds
    assert prio("cluster", "0.5", "balanced", seed=None) == 50
    assert prio("cluster", "0.25", "balanced", seed=None) == 25
    # model a costs a quarter of b per step (2 x 64^2 against 2 x 128^2)
    assert prio("full", "1", "balanced", model="a", seed=None) == 25
    # a time-only run: 1 epoch of 3, one seed
    assert prio("cluster", "0.5", "random", gpus="2") == round(100 * 0.5 * 1 * 1 / (3 * 2))
    assert prio("cluster", "0.5", "random", gpus="2") < prio("cluster", "0.25", "balanced",
                                                             seed=None)


def test_model_cost_reads_size_names_and_leaves_hub_models_at_one() -> None:
    from clusterft.stages.models import DEFAULTS as MODEL_DEFAULTS

    small_preset = MODEL_DEFAULTS["sizes"]["small"]
    cfg = small()
    cfg["models"] = {"a": {"source": "build", "size": "small"},
                     "b": {"source": "build", "size": {"hidden_size": small_preset["hidden_size"],
                                                        "num_hidden_layers": 1}},
                     "c": {"source": "hub", "hub_id": "some/model"}}
    jobs = Inputs({}, Sweep(cfg))
    assert jobs.model_cost("a") == 1.0
    assert jobs.model_cost("b") == pytest.approx(1 / small_preset["num_hidden_layers"])
    assert jobs.model_cost("c") == 1.0
