"""Per-job memory and runtime that follow the model and the pool, and grow on retry.

A rule's fixed `mem_mb` fits the embedded default's few-million-parameter models; a Llama-2
13B job needs tens of GB of host memory (its weights pass through host memory while they
load, 26 GB in bf16, 52 GB in float32) and clustering 75k x 32k features needs 10 GB. So a
job asks for the larger of the rule's fixed value and an estimate from the model's
parameter count (`models.<name>.hub_id` in `analysis.costmodel.KNOWN_PARAMS`, or a local
model folder's config.json) and the pool's size (`datasets.<name>.n`), times the attempt:
a job SLURM killed for memory (or time) is resubmitted (`retries` in the profile) with
twice, then three times as much.

Estimates are weights, gradients, optimiser moments and feature matrices in bytes, with a
fixed allowance for the process (2 GB); activations live on the GPU. Pure functions over
the config; nothing here imports torch.

Runtime (minutes, sbatch -t) = max(the rule's fixed value, ceil(safety x estimate)) x the
attempt, at most `resources.max_runtime` where that is set. The estimate is the cost
model's for that very job (`clusterft.tools.cost.Estimator.job_seconds`, handed to
`clusterft.plan.inputs.Inputs` by the rule files; the numbers of `clusterft cost`'s per-job
table: FLOPs per token over the pool's or the selection's tokens, the sampler's token plan
for train, an H100's bf16 peak at MFU 0.3), for the jobs that run on a GPU: train,
train_seeds, score (score_warmup, score_shard), embedding_features and the evaluate jobs; on
a CPU these keep their fixed values, which are sized for the embedded default's models. Two
CPU rules get estimates of their own: cluster (one core's k-means,
`costmodel.kmeans_seconds`, measured per row x column x centroid x iteration) and
base_model for a hub or local checkpoint (its weights read and written at
`costmodel.COPY_BYTES_PER_SECOND`). A config whose datasets or models the cost model has no
numbers for (no tokens-per-example estimate, no parameter count) keeps the fixed values.

The safety factor, `resources.runtime_safety`, defaults to RUNTIME_SAFETY = 3: the estimate
rests on an assumed utilisation (MFU 0.3; plain Hugging Face LoRA training with gradient
checkpointing may reach half that: x2), on tokens-per-example guesses for the hub pools
that are good to a factor of about 1.5 (`clusterft.tools.cost.TOKENS_PER_EXAMPLE`), and it
leaves out loading the model and tokenising the pool (minutes); 2 x 1.5 is 3. A job that
still runs out of time is resubmitted with twice as much (`retries` in the profile), and
score (and train, with train.checkpoint_every) resumes from its checkpoints. The factor
does not cover slower GPUs: the estimate is for an H100 (989 TFLOP/s bf16); on an A100
(312) raise it about 3-fold.

SLURM's limit: a job that asks for more than its partition's MaxTime is not refused by
sbatch on every cluster; it may wait in the queue for ever (reason PartitionTimeLimit). So
`resources.max_runtime` (the partition's limit, minutes) caps every request, retries
included, and a job whose estimate exceeds it is named in a warning when the DAG is built
(with the setting that splits it: score.shards, evaluate.shards, cluster.n_init); without
it, runtimes are not capped and the jobs over a day are named instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MB = 1024 ** 2
RUNTIME_SAFETY = 3.0  # resources.runtime_safety's default (the module docstring says why)
DAY_MINUTES = 24 * 60  # without resources.max_runtime, longer jobs are named in a warning
# Rules whose runtime the GPU cost model estimates (when they run on a GPU).
GPU_RULES = ("train", "train_seeds", "score", "score_warmup", "score_shard",
             "embedding_features", "evaluate", "evaluate_base", "evaluate_shard",
             "evaluate_base_shard", "evaluate_seeds")
# What splits a job that does not fit a partition's time limit.
SPLIT_HINTS = {"score": "score.shards splits the gradient pass over jobs",
               "score_shard": "more score.shards",
               "evaluate_shard": "more evaluate.shards",
               "evaluate_base_shard": "more evaluate.shards",
               "evaluate": "evaluate.shards splits a run's tasks over jobs",
               "evaluate_base": "evaluate.shards splits a run's tasks over jobs",
               "cluster": "fewer cluster.n_init restarts or cluster.max_iter iterations",
               "train": "with train.checkpoint_every the retry resumes where the job stopped"}
PROCESS_MB = 2048  # interpreter, torch, tokenizer, buffers on the host
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def llama_params(c: dict) -> float:
    """Parameter count of a Llama-shaped HF config (config.json as a dict)."""
    h, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    heads = int(c.get("num_attention_heads") or 1)
    kv = h * int(c.get("num_key_value_heads") or heads) // heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    head = 0 if c.get("tie_word_embeddings", False) else vocab * h
    return float(vocab * h + head + layers * per_layer + h)


def model_params(spec: dict) -> float:
    """Parameters of a configured model: a hub id the cost model knows, or a local folder's
    config.json; 0 where neither tells (the rules' fixed values then apply)."""
    from clusterft.analysis.costmodel import KNOWN_PARAMS

    if spec.get("hub_id") in KNOWN_PARAMS:
        return float(KNOWN_PARAMS[spec["hub_id"]])
    cfg = Path(str(spec.get("path") or "")) / "config.json"
    if spec.get("path") and cfg.is_file():
        try:
            return llama_params(json.loads(cfg.read_text(encoding="utf-8")))
        except (KeyError, ValueError, TypeError):
            return 0.0
    return 0.0


def score_width(cfg: dict) -> int:
    """Columns of the gradient features: the projection size per warm-up checkpoint."""
    s = cfg["score"]
    return int(s["dim"]) * max(1, int(s["warmup_checkpoints"]))


def estimate_mb(rule: str, cfg: dict, model: str | None, dataset: str | None,
                ranks: int = 1) -> int:
    """Host memory (MB) of one job of ``rule`` before the attempt factor; 0 when the config
    gives nothing to estimate from."""
    p = model_params(cfg["models"][model]) if model else 0.0
    n = int((cfg["datasets"].get(dataset) or {}).get("n") or 0) if dataset else 0
    if rule in ("score", "score_warmup", "score_shard"):
        # the model in float32 on the host while it loads; features, and their merge copy
        need = p * 4 + n * score_width(cfg) * 4 * 2
    elif rule == "score_merge":  # the shards' features, no model
        need = n * score_width(cfg) * 4 * 2
    elif rule == "embedding_features":
        need = p * 4
    elif rule == "cluster":
        width = max(score_width(cfg), int(cfg["features"]["dim"]))
        need = n * width * 4 * 3  # features, normalised copy, faiss/numpy work space
    elif rule == "base_model":
        need = p * 4 * 2  # loaded and written
    elif rule in ("train", "train_seeds"):
        t = cfg["model_train"][model]
        on_gpu = t["device"] == "cuda"
        if t["finetune"] == "full":
            per_rank = p * 4 if on_gpu else p * 16  # CPU: weights, grads, 2 AdamW moments
        else:
            per_rank = p * 2 if on_gpu else p * 4  # frozen base; adapters are small
        need = per_rank * ranks
    elif rule.startswith("evaluate"):
        need = p * DTYPE_BYTES.get(str(cfg["evaluate"]["dtype"]), 4)
    else:
        return 0
    return int(PROCESS_MB + need / MB) if need else 0


def memory_mb(fixed: int, estimate: int, attempt: int = 1) -> int:
    """The larger of a rule's fixed value and the estimate, times the attempt (1, 2, ...)."""
    return int(max(int(fixed), int(estimate)) * max(1, int(attempt)))


def model_hidden(spec: dict) -> int:
    """Hidden size of a configured model (the embedding features' width): a hub id the cost
    model knows, or a local folder's config.json; 0 where neither tells."""
    from clusterft.analysis.costmodel import KNOWN_CONFIGS

    if spec.get("hub_id") in KNOWN_CONFIGS:
        return int(KNOWN_CONFIGS[spec["hub_id"]]["hidden_size"])
    cfg = Path(str(spec.get("path") or "")) / "config.json"
    if spec.get("path") and cfg.is_file():
        try:
            return int(json.loads(cfg.read_text(encoding="utf-8"))["hidden_size"])
        except (KeyError, ValueError, TypeError):
            return 0
    return 0


def estimate_minutes(rule: str, cfg: dict, w: dict, est: Any = None, on_gpu: bool = False,
                     merged: bool = False) -> float:
    """The cost model's minutes for one job of ``rule`` (wildcards ``w``) before the safety
    factor; 0 where it has nothing to say (a CPU job of a GPU rule, a rule without work worth
    estimating, a dataset or model without numbers). ``est``: the cost model of the
    settled config (`clusterft.tools.cost.runtime_estimator(cfg)`, handed in by the rules:
    it lives a layer above this one; None: no GPU estimates);
    ``merged``: a score or evaluate job that merges shards, or a time-only train run."""
    from clusterft.analysis.costmodel import COPY_BYTES_PER_SECOND, kmeans_seconds

    if rule in GPU_RULES:
        if not on_gpu or est is None:
            return 0.0
        try:
            return est.job_seconds(rule, w, merged)[1] / 60
        except KeyError:  # no tokens per example or parameters for this dataset or model
            return 0.0
    if rule == "cluster":
        c, n = cfg["cluster"], int((cfg["datasets"].get(w["dataset"]) or {}).get("n") or 0)
        width = {"gradient": score_width(cfg), "tfidf": int(cfg["features"]["dim"]),
                 "loss": int(cfg["score"]["loss_points"]),
                 "embedding": model_hidden(cfg["models"][w["model"]])}.get(w.get("kind"), 0)
        return kmeans_seconds(n, width, int(c["k"]), int(c["max_iter"]), int(c["n_init"]),
                              str(c["backend"])) / 60
    if rule == "base_model":  # a checkpoint read and written; a built model: pretraining
        spec = cfg["models"][w["model"]]
        if spec.get("source", "build") == "build":
            return 0.0
        return model_params(spec) * 2 * 2 / COPY_BYTES_PER_SECOND / 60  # bf16, in and out
    return 0.0


def runtime_need(fixed: int, estimate: float, safety: float = RUNTIME_SAFETY) -> int:
    """Minutes a first attempt asks for: the rule's fixed value or ceil(safety x estimate)."""
    return max(int(fixed), math.ceil(float(safety) * float(estimate)))


def runtime_minutes(fixed: int, estimate: float, attempt: int = 1,
                    safety: float = RUNTIME_SAFETY, ceiling: int | None = None) -> int:
    """`runtime_need` times the attempt (1, 2, ...), at most ``ceiling`` when given."""
    minutes = runtime_need(fixed, estimate, safety) * max(1, int(attempt))
    return min(minutes, int(ceiling)) if ceiling else minutes


__all__ = ["DAY_MINUTES", "GPU_RULES", "RUNTIME_SAFETY", "estimate_mb", "estimate_minutes",
           "llama_params", "memory_mb", "model_hidden", "model_params", "runtime_minutes",
           "runtime_need", "score_width"]
