"""The cost table (`python -m clusterft.tools.cost`): its jobs are the workflow's own (per-rule
counts equal an independent `snakemake -n`), and its GPU-hours follow the cost model's
arithmetic exactly on a small config where every number can be worked out by hand."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterft.tools import cost
from clusterft.analysis.costmodel import DRAWS_PER_SECOND, H100_BF16_FLOPS, KNOWN_PARAMS
from clusterft.pipeline.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "config" / "paper.yaml"


def dry_run_counts(config: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-F", "--quiet", "rules",
                          "--configfile", str(config)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return cost.job_stats(out.stdout + out.stderr)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_paper_config_counts_per_rule_equal_the_dry_run(tmp_path: Path) -> None:
    expected = dry_run_counts(PAPER)
    assert expected.get("train", 0) > 100  # the paper sweep, not an empty DAG
    rc = cost.main(["--config", str(PAPER), "--out", str(tmp_path / "cost")])
    assert rc == 0
    table = read_csv(tmp_path / "cost.csv")
    got = {r["rule"]: int(r["jobs"]) for r in table if r["rule"] != "total"}
    assert got == expected
    total = table[-1]
    assert total["rule"] == "total" and int(total["jobs"]) == sum(expected.values())
    assert float(total["gpu_hours"]) == pytest.approx(
        sum(float(r["gpu_hours"]) for r in table[:-1]), abs=0.01)
    gpu = {r["rule"]: float(r["gpu_hours"]) for r in table}
    assert gpu["train"] > 0 and gpu["select"] == 0 and gpu["cluster"] == 0
    jobs = read_csv(tmp_path / "cost_jobs.csv")
    assert len(jobs) == sum(expected.values())
    md = (tmp_path / "cost.md").read_text(encoding="utf-8")
    assert "| **total** |" in md and "MFU" in md


def small_config(path: Path) -> Path:
    """One hub dataset of 6400 examples, the 7B model, one seed; full and random-0.5 at 4
    GPUs (accuracy: balanced; time: random and balanced)."""
    cfg = yaml.safe_load(PAPER.read_text(encoding="utf-8"))
    cfg["datasets"] = {"codealpaca": {**cfg["datasets"]["codealpaca"], "n": 6400}}
    cfg["models"] = {"llama7b": cfg["models"]["llama7b"]}
    cfg["seeds"] = [0]
    cfg["score"] = {"dim": 8192}
    # the arithmetic below counts no activation recompute
    cfg["train"] = {**cfg["train"], "gradient_checkpointing": False}
    cfg["evaluate"] = {k: v for k, v in cfg["evaluate"].items() if k != "shards"}
    cfg["sweep"] = {"methods": ["full", "random"], "budgets": [0.5],
                    "accuracy": {"gpus": 4, "distribution": "balanced"},
                    "time": {"methods": ["random"], "budgets": [0.5], "gpus": [4],
                             "distributions": ["random", "balanced"], "seeds": [0]}}
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_gpu_hours_arithmetic_on_a_small_config(tmp_path: Path) -> None:
    config = small_config(tmp_path / "small.yaml")
    mfu, overhead, tpe = 0.5, 0.1, 104  # 104: a multiple of pad_to_multiple_of (8)
    table = cost.run_cost(config, tmp_path / "cost", {"codealpaca": tpe}, None, mfu=mfu,
                          step_overhead_s=overhead, length_sigma=0.0)
    gpu = {t["rule"]: t["gpu_hours"] for t in table}
    jobs = {t["rule"]: t["jobs"] for t in table}
    N = KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"]
    per_flop = 1 / (H100_BF16_FLOPS * mfu)
    # train: LoRA 4N per token; 64 per step = 16 per GPU x 104 tokens, no padding; 4 epochs
    # of 100 steps (full) and of 50 steps (random 0.5), each with both distributions.
    step = 16 * tpe * 4 * N * per_flop + overhead
    assert jobs["train"] == 4
    assert gpu["train"] == pytest.approx(2 * 4 * (100 + 50) * step * 4 / 3600, rel=1e-9)
    # score: warm-up 5% x 4 epochs (LoRA), 1 gradient pass (LoRA), 5 loss points (2N), and
    # the dense projection of the pass: D = 32 layers x r 8 x (in + out) LoRA weights of the
    # score stage's modules (q/k/v/o 4096 + 4096; gate/up/down 4096 + 11008), 2 D dim FLOPs
    # per example, D dim draws per batch of 16
    pool_tokens = 6400 * tpe
    D, dim = 32 * 8 * (4 * (4096 + 4096) + 3 * (4096 + 11008)), 8192
    projection = 2 * D * dim * 6400 * per_flop + D * dim * (6400 // 16) / DRAWS_PER_SECOND
    assert jobs["score"] == 1
    assert gpu["score"] == pytest.approx(
        (pool_tokens * N * (0.05 * 4 * 4 + 4 + 5 * 2) * per_flop + projection) / 3600, rel=1e-9)
    assert gpu["embedding_features"] == pytest.approx(pool_tokens * 2 * N * per_flop / 3600,
                                                      rel=1e-9)
    # evaluate: the two accuracy runs and the base model, the programming tasks each
    tasks = ("humaneval", "mbpp", "mmlu_college_computer_science")
    eval_tokens = sum(cost.EVAL_TASKS[t][0] * (cost.EVAL_TASKS[t][1] + cost.DECODE_PENALTY
                                               * cost.EVAL_TASKS[t][2]) for t in tasks)
    one_eval = eval_tokens * 2 * N * per_flop / 3600
    assert gpu["evaluate"] == pytest.approx(2 * one_eval, rel=1e-9)
    assert gpu["evaluate_base"] == pytest.approx(one_eval, rel=1e-9)
    assert table[-1]["gpu_hours"] == pytest.approx(sum(t["gpu_hours"] for t in table[:-1]))
    # disk: 2 LoRA adapters (paper.yaml's r 128 on q/k/v/o, float32, not merged: the two
    # evaluated runs; the 2 runs that are only timed keep no model), the 7B base as its fp16
    # checkpoint, score's features (dim 8192 + 5 loss points per example)
    disk = {t["rule"]: t["disk_gb"] for t in table}
    assert disk["train"] == pytest.approx(2 * 4 * 32 * 4 * 128 * (4096 + 4096) / 1e9, rel=1e-9)
    assert disk["base_model"] == pytest.approx(2 * N / 1e9, rel=1e-9)
    assert disk["score"] == pytest.approx(4 * 6400 * (8192 + 5) / 1e9, rel=1e-9)
    assert table[-1]["disk_gb"] == pytest.approx(sum(t["disk_gb"] for t in table[:-1]))


def test_a_dataset_s_own_epochs_scale_its_train_estimate(tmp_path: Path) -> None:
    """datasets.<name>.train.epochs sets the epochs the estimate counts for that dataset's
    runs only (sweep.time.epochs still sets the time-only runs')."""
    cfg = yaml.safe_load(small_config(tmp_path / "small.yaml").read_text(encoding="utf-8"))
    spec = cfg["datasets"]["codealpaca"]
    cfg["datasets"]["twice"] = {**spec, "train": {"epochs": 2 * cfg["train"]["epochs"]}}
    tpe = {"codealpaca": 104, "twice": 104}
    est = cost.Estimator(cfg, tpe, {"llama7b": KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"]})
    w = {"model": "llama7b", "method": "random", "budget": "0.5", "gpus": "4",
         "dist": "balanced", "seed": "0"}
    once = est.job_seconds("train", {**w, "dataset": "codealpaca"})[1]
    assert once > 0
    assert est.job_seconds("train", {**w, "dataset": "twice"})[1] == pytest.approx(2 * once)
    assert est.job_seconds("train", {**w, "dataset": "twice"}, merged=True)[1] == \
        pytest.approx(2 * once)  # time-only, sweep.time.epochs unset: the dataset's
    cfg["sweep"]["time"]["epochs"] = 1
    est = cost.Estimator(cfg, tpe, {"llama7b": KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"]})
    assert est.job_seconds("train", {**w, "dataset": "twice"}, merged=True)[1] == \
        pytest.approx(est.job_seconds("train", {**w, "dataset": "codealpaca"}, merged=True)[1])


def test_the_kronecker_projection_costs_a_fraction_of_the_dense_one() -> None:
    from clusterft.analysis.costmodel import KNOWN_CONFIGS, lora_matrices, projection_work

    m = lora_matrices(KNOWN_CONFIGS["meta-llama/Llama-2-13b-hf"],
                      {"r": 128, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    assert len(m) == 2 * 4 * 40 and sum(i * o for i, o in m) == 40 * 4 * 128 * 2 * 5120
    n, tokens = 75000, 75000 * 450
    dense = projection_work(m, 8192, "rademacher", tokens, n, n / 8)
    kron = projection_work(m, 8192, "kronecker", tokens, n, n / 8)
    assert kron[1] == 0 and dense[1] == sum(i * o for i, o in m) * 8192 * n / 8
    assert kron[0] < 0.01 * dense[0]  # and no draws: the dense pass is dominated by them


def test_missing_estimates_and_bad_overrides_are_named(tmp_path: Path) -> None:
    config = small_config(tmp_path / "small.yaml")
    cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    cfg["datasets"]["codealpaca"]["hf_dataset"] = "someone/unknown-dataset"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    with pytest.raises(InputError, match="codealpaca.*--tokens-per-example codealpaca=N"):
        cost.run_cost(config, tmp_path / "cost")
    assert not (tmp_path / "cost.csv").exists()
    assert cost.main(["--config", str(config), "--tokens-per-example", "codealpaca=lots",
                      "--out", str(tmp_path / "cost")]) == 2


def test_dry_run_parse_checks_its_own_job_stats() -> None:
    text = ("rule train:\n    wildcards: dataset=a, gpus=4\n    resources: gpu=4\n\n"
            "Job stats:\njob      count\n-----  -------\ntrain        2\ntotal        2\n")
    with pytest.raises(RuntimeError, match="job stats"):
        cost.parse_dry_run(text)
    jobs = cost.parse_dry_run(text.replace("train        2", "train        1"))
    assert jobs == [{"rule": "train", "wildcards": {"dataset": "a", "gpus": "4"},
                     "resources": {"gpu": "4"}}]


def test_fused_seed_jobs_cost_what_their_seeds_cost_apart(tmp_path: Path) -> None:
    """sweep.accuracy.fuse_seeds turns a one-GPU run's seeds into one train_seeds and one
    evaluate_seeds job: fewer jobs, the same GPU-hours as the one-job-per-seed plan."""
    def plan(fuse: bool) -> dict:
        path = small_config(tmp_path / f"fuse{fuse}.yaml")
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        cfg["seeds"] = [0, 1]
        cfg["sweep"]["accuracy"].update(gpus=1, fuse_seeds=fuse)
        path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        table = cost.run_cost(path, tmp_path / f"cost{fuse}", {"codealpaca": 104}, None)
        return {t["rule"]: t for t in table}

    apart, fused = plan(False), plan(True)
    assert "train_seeds" not in apart and "evaluate_seeds" not in apart
    # 2 accuracy runs (full, random 0.5) x 2 seeds; the 4 time runs (full and random 0.5 x
    # 2 distributions, 4 GPUs, seed 0) stay train jobs
    assert (apart["train"]["jobs"], fused["train_seeds"]["jobs"], fused["train"]["jobs"]) == (8, 2, 4)
    assert (apart["evaluate"]["jobs"], fused["evaluate_seeds"]["jobs"]) == (4, 2)
    assert fused["train_seeds"]["gpu_hours"] + fused["train"]["gpu_hours"] == pytest.approx(
        apart["train"]["gpu_hours"], rel=1e-9)
    assert fused["evaluate_seeds"]["gpu_hours"] == pytest.approx(apart["evaluate"]["gpu_hours"],
                                                                 rel=1e-9)
    assert fused["total"]["gpu_hours"] == pytest.approx(apart["total"]["gpu_hours"], rel=1e-9)


def test_the_jobs_come_from_the_plan_without_running_snakemake(tmp_path: Path,
                                                               monkeypatch) -> None:
    """The job list is clusterft.plan.sweep's (no snakemake run); it equals the dry run's,
    rule and wildcards, job for job."""
    config = small_config(tmp_path / "small.yaml")
    dry = cost.dry_run_jobs(config)

    def no_snakemake(*args, **kwargs):
        raise AssertionError("the cost tool ran a subprocess")

    monkeypatch.setattr(cost.subprocess, "run", no_snakemake)
    cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    planned = cost.plan_jobs(cfg)
    key = lambda jobs: sorted((j["rule"], sorted(j["wildcards"].items())) for j in jobs)  # noqa: E731
    assert key(planned) == key(dry)
    table = cost.run_cost(config, tmp_path / "cost", {"codealpaca": 104}, None)
    assert table[-1]["jobs"] == len(dry)
