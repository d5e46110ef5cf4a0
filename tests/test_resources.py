"""Per-job memory that follows the model and the pool and grows on retry
(clusterft.plan.resources, wired into the rules through clusterft.plan.inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clusterft.analysis.costmodel import KNOWN_PARAMS
from clusterft.plan.config import prepare
from clusterft.plan.inputs import Inputs
from clusterft.plan.resources import estimate_mb, llama_params, memory_mb
from clusterft.plan.sweep import Sweep

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 ** 2  # mem_mb counts MiB
P7, P13 = KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"], KNOWN_PARAMS["meta-llama/Llama-2-13b-hf"]
# The rules' fixed mem_mb (workflow/rules/*.smk; train: per rank on the node).
FIXED = {"base_model": 8000, "score": 8000, "score_warmup": 8000, "score_shard": 8000,
         "embedding_features": 4000, "cluster": 4000, "train": 4000, "train_seeds": 4000,
         "evaluate": 4000, "evaluate_shard": 4000, "evaluate_seeds": 4000}


def jobs_of(config: str) -> tuple[Inputs, list[dict]]:
    cfg = yaml.safe_load((ROOT / config).read_text(encoding="utf-8"))
    plan = Sweep(prepare(cfg, source=config, warn=lambda m: None))
    return Inputs(cfg, plan), plan.jobs()


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
            seen.add(j["rule"])
    assert {"score", "cluster", "train", "base_model"} <= seen


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
    assert [inputs.runtime(120)(w, attempt=a) for a in (1, 2, 3)] == [120, 240, 360]
    assert memory_mb(4000, 0, 3) == 12000
    assert estimate_mb("select", inputs.cfg, "llama13b", "magicoder") == 0  # no model loaded
