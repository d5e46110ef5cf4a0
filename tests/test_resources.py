"""Per-job memory and runtime that follow the model and the pool and grow on retry
(clusterft.plan.resources, wired into the rules through clusterft.plan.inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clusterft.analysis.costmodel import KNOWN_PARAMS
from clusterft.plan.config import prepare
from clusterft.plan.inputs import Inputs
from clusterft.plan.resources import (RUNTIME_SAFETY, estimate_mb, llama_params, memory_mb,
                                      runtime_minutes)
from clusterft.plan.sweep import Sweep
from clusterft.tools.cost import runtime_estimator

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 ** 2  # mem_mb counts MiB
P7, P13 = KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"], KNOWN_PARAMS["meta-llama/Llama-2-13b-hf"]
# The rules' fixed mem_mb (workflow/rules/*.smk; train: per rank on the node).
FIXED = {"base_model": 8000, "score": 8000, "score_warmup": 8000, "score_shard": 8000,
         "embedding_features": 4000, "cluster": 4000, "train": 4000, "train_seeds": 4000,
         "evaluate": 4000, "evaluate_shard": 4000, "evaluate_seeds": 4000}
# The rules' fixed runtimes (minutes) at 3 seeds (train_seeds and evaluate_seeds: per seed).
RUNTIME = {"base_model": 120, "score": 240, "score_warmup": 240, "score_shard": 240,
           "embedding_features": 60, "cluster": 30, "train": 600, "train_seeds": 1800,
           "evaluate": 120, "evaluate_shard": 120, "evaluate_seeds": 360}


def jobs_of(config: str, edit=None, warn=None) -> tuple[Inputs, list[dict]]:
    cfg = yaml.safe_load((ROOT / config).read_text(encoding="utf-8"))
    if edit:
        edit(cfg)
    plan = Sweep(prepare(cfg, source=config, warn=lambda m: None))
    return Inputs(cfg, plan, cost=runtime_estimator, warn=warn or (lambda m: None)), plan.jobs()


def train_job(jobs: list[dict], **want) -> dict:
    return next(j["wildcards"] for j in jobs if j["rule"] == "train"
                and all(j["wildcards"][k] == v for k, v in want.items()))


def test_the_llama_count_matches_the_published_sizes():
    seven = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
             "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 32}
    thirteen = {**seven, "hidden_size": 5120, "num_hidden_layers": 40,
                "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40}
    assert llama_params(seven) == pytest.approx(KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"], rel=1e-3)
    assert llama_params(thirteen) == pytest.approx(KNOWN_PARAMS["meta-llama/Llama-2-13b-hf"],
                                                   rel=1e-3)


@pytest.mark.parametrize("config", [".test/config.yaml", "config/config.yaml"])
def test_small_models_keep_the_rules_fixed_values(config):
    """The embedded default and the smoke config ask for what they always did (a CPU SLURM
    node of 24 GB runs the smoke workflow)."""
    inputs, jobs = jobs_of(config)
    seen = set()
    for j in jobs:
        if j["rule"] in FIXED:
            ranks = inputs.train_job(j["wildcards"])["ranks_per_node"] if j["rule"] == "train" else 1
            got = inputs.memory(j["rule"], FIXED[j["rule"]])(j["wildcards"], attempt=1)
            assert got == FIXED[j["rule"]] * ranks, j
            for attempt in (1, 2):  # runtimes: the fixed values too, on CPU
                got = inputs.runtime(j["rule"], RUNTIME[j["rule"]])(j["wildcards"], attempt)
                assert got == RUNTIME[j["rule"]] * attempt, j
            seen.add(j["rule"])
    assert {"score", "cluster", "train", "base_model"} <= seen


def test_the_smoke_dry_run_asks_for_the_fixed_runtimes():
    """What `snakemake -n` prints for the smoke config: every job's runtime is its rule's
    fixed value (times the seeds for the fused jobs), as before runtimes followed the model."""
    from clusterft.tools.cost import dry_run_jobs

    seeds = len(yaml.safe_load((ROOT / ".test/config.yaml").read_text())["seeds"])
    fixed = {**RUNTIME, "evaluate_base": 120, "evaluate_base_shard": 120,
             "train_seeds": 600 * seeds, "evaluate_seeds": 120 * seeds}
    jobs = [j for j in dry_run_jobs(ROOT / ".test/config.yaml") if j["rule"] in fixed]
    assert {j["rule"] for j in jobs} >= {"score", "cluster", "base_model"}
    assert all(int(j["resources"]["runtime"]) == fixed[j["rule"]] for j in jobs), jobs


def test_seven_and_thirteen_b_jobs_ask_for_their_weights():
    inputs, jobs = jobs_of("config/paper.yaml")
    mem = {}
    for j in jobs:
        if j["rule"] in FIXED:
            w = j["wildcards"]
            mem.setdefault((j["rule"], w.get("model"), w.get("dataset"), w.get("gpus")),
                           inputs.memory(j["rule"], FIXED[j["rule"]])(w, attempt=1))
    # evaluate in bf16 (evaluate.dtype): 13.5 GB / 26 GB of weights
    assert P7 * 2 / MB < mem[("evaluate_shard", "llama7b", "codealpaca", "8")] < P7 * 3 / MB
    assert P13 * 2 / MB < mem[("evaluate_shard", "llama13b", "codealpaca", "8")] < P13 * 3 / MB
    # score loads float32 (52 GB for 13B) and holds the pool's features
    assert mem[("score", "llama13b", "magicoder", None)] > P13 * 4 / MB
    assert mem[("score", "llama13b", "magicoder", None)] > mem[("score", "llama13b", "codealpaca", None)]
    # a LoRA train job on 8 GPUs: each rank's bf16 base passes through host memory
    assert mem[("train", "llama13b", "codealpaca", "8")] > 8 * P13 * 2 / MB
    assert mem[("train", "llama7b", "codealpaca", "8")] > 8 * P7 * 2 / MB
    # 75k examples x 4 checkpoints x 8192 dims in float32, with work space
    assert mem[("cluster", "llama7b", "magicoder", None)] > 75000 * 4 * 8192 * 4 * 3 / MB


def test_memory_and_runtime_grow_with_the_attempt():
    inputs, jobs = jobs_of("config/paper.yaml")
    w = next(j["wildcards"] for j in jobs if j["rule"] == "evaluate_shard")
    one, two = (inputs.memory("evaluate_shard", 4000)(w, attempt=a) for a in (1, 2))
    assert two == 2 * one
    assert [inputs.runtime("evaluate_shard", 120)(w, attempt=a) for a in (1, 2, 3)] == [
        120, 240, 360]  # the estimate (a few minutes) is under the fixed value
    assert memory_mb(4000, 0, 3) == 12000
    assert estimate_mb("select", inputs.cfg, "llama13b", "magicoder") == 0  # no model loaded


def test_paper_runtimes_follow_the_model_size():
    """Runtimes on the paper config: the larger of the rule's fixed value and the safety
    factor times the cost model's estimate for the job (clusterft.tools.cost)."""
    from clusterft.tools.cost import Estimator, TOKENS_PER_EXAMPLE

    inputs, jobs = jobs_of("config/paper.yaml")
    run = dict(dataset="magicoder", method="full", budget="1", gpus="4")
    w7, w13 = train_job(jobs, model="llama7b", **run), train_job(jobs, model="llama13b", **run)
    hours = {w["model"]: inputs.runtime_estimate("train", w) / 60 for w in (w7, w13)}
    # the cost table's own number for the job (`clusterft cost`), before the factor
    est = Estimator(inputs.cfg, {d: TOKENS_PER_EXAMPLE[s["hf_dataset"]]
                                 for d, s in inputs.cfg["datasets"].items()},
                    {"llama7b": P7, "llama13b": P13})
    assert hours["llama13b"] * 3600 == pytest.approx(est.job_seconds("train", w13)[1], rel=1e-9)
    assert hours["llama13b"] > 1.5 * hours["llama7b"] > 1.0  # 13B: about twice the FLOPs
    # a fixed value below both estimates: 13B > 7B > fixed
    seven, thirteen = (inputs.runtime("train", 60)(w, attempt=1) for w in (w7, w13))
    assert thirteen > seven > 60 and seven == pytest.approx(RUNTIME_SAFETY * hours["llama7b"] * 60,
                                                            abs=1)
    # the rule's own value (600): the 13B job outgrows it, the 7B one (2.2 h x 3) does not
    assert inputs.runtime("train", 600)(w13) > 600 == inputs.runtime("train", 600)(w7)
    # the GPU-bound rules on the paper's largest pool, and clustering its gradient features
    score = {m: inputs.runtime("score", 240)({"dataset": "magicoder", "model": m, "seed": "0"})
             for m in ("llama7b", "llama13b")}
    assert score["llama13b"] > score["llama7b"] > 240
    cluster = inputs.runtime("cluster", 30)({"dataset": "magicoder", "model": "llama7b",
                                             "kind": "gradient", "seed": "0"})
    assert cluster > 30
    small = inputs.runtime("score", 240)({"dataset": "codealpaca", "model": "llama7b", "seed": "0"})
    assert small == 240  # 20 min of work: the fixed value
    # without the cost model (what the rule files hand in) every job keeps its fixed value
    bare = Inputs(inputs.config, inputs.plan)
    assert bare.runtime("train", 600)(w13) == 600 and bare.runtime("score", 240)(
        {"dataset": "magicoder", "model": "llama13b", "seed": "0"}) == 240


def test_a_retry_asks_for_twice_the_time_up_to_max_runtime():
    inputs, jobs = jobs_of("config/paper.yaml")
    w = train_job(jobs, model="llama13b", dataset="magicoder", method="full", budget="1",
                  gpus="4")
    one, two = (inputs.runtime("train", 600)(w, attempt=a) for a in (1, 2))
    assert one > 600 and two == 2 * one
    assert runtime_minutes(30, 100.0, 2, 3.0) == 600 and runtime_minutes(30, 1.0, 3, 3.0) == 90
    # resources.max_runtime caps every attempt, and names the job that does not fit
    said: list[str] = []
    capped, jobs = jobs_of("config/paper.yaml",
                           lambda c: c.update(resources={"max_runtime": 720}), said.append)
    assert [capped.runtime("train", 600)(w, attempt=a) for a in (1, 2)] == [720, 720]
    small = train_job(jobs, model="llama7b", dataset="codealpaca", method="full", budget="1",
                      gpus="8")
    assert [capped.runtime("train", 600)(small, attempt=a) for a in (1, 2)] == [600, 720]
    assert len(said) == 1 and "train (dataset=magicoder, model=llama13b)" in said[0]
    assert "max_runtime caps it at 12.0 h" in said[0]
    capped.runtime("train", 600)(w)
    assert len(said) == 1  # once per rule, dataset and model


def test_jobs_over_a_day_are_named_without_max_runtime():
    said: list[str] = []
    inputs, _ = jobs_of("config/paper.yaml", warn=said.append)
    w = {"dataset": "magicoder", "model": "llama13b", "seed": "0"}
    assert inputs.runtime("score", 240)(w) > 24 * 60
    assert len(said) == 1 and said[0].startswith("score (dataset=magicoder, model=llama13b)")
    assert "resources.max_runtime" in said[0] and "score.shards" in said[0]
    # slower GPUs: a larger factor, the same estimate
    slow, _ = jobs_of("config/paper.yaml", lambda c: c.update(resources={"runtime_safety": 9}))
    assert slow.runtime("score", 240)(w) == pytest.approx(3 * inputs.runtime("score", 240)(w),
                                                          abs=3)
