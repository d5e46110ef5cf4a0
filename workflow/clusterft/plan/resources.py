"""Per-job memory that follows the model and the pool, and grows on retry.

A rule's fixed `mem_mb` fits the embedded default's few-million-parameter models; a Llama-2
13B job needs tens of GB of host memory (its weights pass through host memory while they
load, 26 GB in bf16, 52 GB in float32) and clustering 75k x 32k features needs 10 GB. So a
job asks for the larger of the rule's fixed value and an estimate from the model's
parameter count (`models.<name>.hub_id` in `analysis.costmodel.KNOWN_PARAMS`, or a local
model folder's config.json) and the pool's size (`datasets.<name>.n`), times the attempt:
a job SLURM killed for memory (or time) is resubmitted (`retries` in the profile) with
twice, then three times as much. Runtimes are the rules' fixed values times the attempt:
for 7B/13B set them from the cost table's per-job hours (`clusterft cost`; docs/slurm.md).

Estimates are weights, gradients, optimiser moments and feature matrices in bytes, with a
fixed allowance for the process (2 GB); activations live on the GPU. Pure functions over
the config; nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MB = 1024 ** 2
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


__all__ = ["estimate_mb", "llama_params", "memory_mb", "model_params", "score_width"]
