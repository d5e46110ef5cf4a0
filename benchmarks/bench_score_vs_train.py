"""Scoring cost per example against one training step's cost per example (issue 14, item 2:
target <= 1.5x), side by side in one process on the same model, data and threads.

Score: ``clusterft.stages.score.compute_features_info`` (the score stage: LoRA warm-up, the
loss-trajectory passes, then the per-example gradient pass and projection) with
``score.projection`` rademacher (dense) and kronecker; its seconds per pool example with the
warm-up (``score.warmup.warmup_lora``: LoRA steps, and ``pool_losses``: the loss passes)
excluded and included (the whole call). Train:
``clusterft.stages.train.train_loop`` (the train stage's loop: micro-batched forward/backward,
clipping, AdamW, schedule) for ``--epochs`` epochs over the same examples; its seconds per
example trained (loop seconds / (steps x global batch)). Both with the embedded default's
``score`` and ``train`` sections (config/config.yaml) on a randomly initialised Llama of its
``models.<size>.size`` and a tokenizer trained on local text, on synthetic instruction
pairs of 60-100 tokens (benchmarks/bench_score.py's ``synthetic_pool``). The variants are
interleaved ``--repeats`` times; medians are printed, the ratios last, from wall seconds and
from the process's CPU seconds (with ``--threads 1`` these hardly change when other
processes share the cores, where wall seconds do). Three score figures: the gradient pass
alone, the method (the warm-up's LoRA steps and the gradient pass), and the whole stage
(with the ``score.loss_points`` no-grad loss passes over the pool that S2L's trajectories
need, computed by the same job). Variants: dense and kronecker projections with the LM
head at the label positions only (``score.sparse_logits``, the default), and dense-full,
the head over every position (the stage before that change). Also printed: one no-grad
loss pass over the pool, with each head.

    python benchmarks/bench_score_vs_train.py [--size small|large] [--n 512] [--threads 1]
    python benchmarks/bench_score_vs_train.py --smoke      (tiny sizes, seconds)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "workflow"), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import yaml  # noqa: E402

SMOKE_SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2}


def setup(size: str, n: int, smoke: bool):
    """(tokenizer, model, pool records, score section, train section) of the embedded
    default (smoke: a tiny model, few warm-up steps)."""
    from bench_score import synthetic_pool, tokenizer_texts
    from clusterft.stages.models import build_model, train_tokenizer

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    tok = train_tokenizer(tokenizer_texts(), 512 if smoke else int(cfg["tokenizer"]["vocab_size"]), None,
                          seed=0)
    model = build_model(tok, SMOKE_SIZE if smoke else cfg["models"][size]["size"], seed=0)
    score_cfg = dict(cfg.get("score") or {})
    train_cfg = dict(cfg.get("train") or {})
    if smoke:
        score_cfg.update(warmup_steps=2, dim=64, batch_size=8)
        train_cfg.update(global_batch_size=8)
    return tok, model, synthetic_pool(n), score_cfg, train_cfg


def time_score(model, tok, pool, score_cfg: dict, projection: str, threads: int,
               sparse_logits: bool = True) -> dict:
    """Wall and CPU seconds of the whole stage call, of its warm-up (``warmup_lora``, the
    LoRA steps, plus the loss passes) and of the loss passes (``pool_losses``, run by the
    gradient pass from the warm-up's snapshots), each timed by wrapping the function, where
    ``clusterft.stages.score.warmup`` looks it up, for this call. ``method`` is the whole
    call less the loss passes: the warm-up's LoRA steps and the gradient pass, what the
    method itself needs (the loss passes are S2L's trajectories)."""
    from clusterft.stages import score
    from clusterft.stages.score import warmup as score_warmup

    cfg = {**score_cfg, "projection": projection, "num_threads": threads,
           "sparse_logits": sparse_logits}
    m = copy.deepcopy(model)
    spent = {"warmup": [0.0, 0.0], "losses": [0.0, 0.0]}
    inner = {"warmup": score_warmup.warmup_lora, "losses": score_warmup.pool_losses}

    def timed(key: str):
        def call(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return inner[key](*args, **kwargs)
            finally:
                spent[key][0] += time.perf_counter() - w0
                spent[key][1] += time.process_time() - c0
        return call

    score_warmup.warmup_lora, score_warmup.pool_losses = timed("warmup"), timed("losses")
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        _, _, _, info = score.compute_features_info(m, tok, pool, cfg, seed=0)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        score_warmup.warmup_lora, score_warmup.pool_losses = inner["warmup"], inner["losses"]
    warm = [spent["warmup"][i] + spent["losses"][i] for i in (0, 1)]  # LoRA steps + losses
    return {"total": wall, "warmup": warm[0], "losses": spent["losses"][0],
            "gradients": wall - warm[0], "method": wall - spent["losses"][0],
            "total_cpu": cpu, "gradients_cpu": cpu - warm[1],
            "method_cpu": cpu - spent["losses"][1],
            "steps": info["warmup_steps"], "lora_dim": info["lora_dim"]}


def time_train(model, tok, pool, train_cfg: dict, epochs: int) -> dict:
    import numpy as np

    from clusterft.modeling.distributed import Dist
    from clusterft.modeling.tokenize import encode_records
    from clusterft.stages.train import train_config, train_loop

    cfg = train_config({**train_cfg, "epochs": epochs})
    examples, _ = encode_records(tok, pool, int(cfg["max_length"]), "truncate")
    m = copy.deepcopy(model)
    m.config.use_cache = False
    c0 = time.process_time()
    metrics = train_loop(m, tok, examples, np.zeros(len(examples), dtype=np.int64), cfg, Dist(),
                         "balanced", seed=0)
    trained = int(metrics["steps"]) * int(metrics["global_batch_size"])
    return {"loop": float(metrics["wall_time_s"]), "loop_cpu": time.process_time() - c0,
            "trained": trained, "tokens": float(metrics["tokens"])}


def time_loss_pass(model, tok, pool, score_cfg: dict, sparse: bool) -> float:
    """One no-grad pass of per-example losses over the pool (what each loss point costs),
    with the LM head at the label positions only (``sparse``) or everywhere."""
    from clusterft.stages.score import _encode_all, merge_cfg, pool_losses

    cfg = merge_cfg(score_cfg)
    encoded, _ = _encode_all(tok, pool, cfg)
    m = copy.deepcopy(model).eval()
    t0 = time.perf_counter()
    pool_losses(m, encoded, int(cfg["batch_size"]), tok.pad_token_id, sparse)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=["small", "large"])
    ap.add_argument("--n", type=int, default=512, help="pool examples")
    ap.add_argument("--epochs", type=int, default=1, help="training epochs timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: a check that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.n, a.repeats = 48, 1
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    tok, model, pool, score_cfg, train_cfg = setup(a.size, a.n, a.smoke)
    n_params = sum(p.numel() for p in model.parameters())
    # dense-full: the dense projection with the LM head over every position
    # (score.sparse_logits false), the stage as it was before the label-only head.
    variants = {"dense": ("rademacher", True), "kronecker": ("kronecker", True),
                "dense-full": ("rademacher", False)}
    runs: dict[str, list[dict]] = {"train": [], **{key: [] for key in variants}}
    loss_pass: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.repeats):  # interleaved, so a slow minute hits every variant
        runs["train"].append(time_train(model, tok, pool, train_cfg, a.epochs))
        for key, (proj, sparse) in variants.items():
            runs[key].append(time_score(model, tok, pool, score_cfg, proj, a.threads, sparse))
        for sparse in loss_pass:
            loss_pass[sparse].append(time_loss_pass(model, tok, pool, score_cfg, sparse))

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    trained = runs["train"][0]["trained"]
    train_pe = med("train", "loop") / trained
    train_cpu = med("train", "loop_cpu") / trained
    print(f"{'smoke: ' if a.smoke else ''}Llama {n_params / 1e6:.2f}M params "
          f"({'tiny' if a.smoke else a.size}), {a.n} synthetic examples, {a.threads} thread(s), "
          f"medians of {a.repeats} interleaved runs")
    print(f"score section {score_cfg}; train section {train_cfg} (timed: {a.epochs} epoch(s))")
    print(f"\n{'stage':<32}{'s total':>9}{'ms/example':>12}{'cpu ms/ex':>11}")
    print(f"{'train loop (' + str(a.epochs) + ' epoch)':<32}{med('train', 'loop'):>9.2f}"
          f"{1e3 * train_pe:>12.2f}{1e3 * train_cpu:>11.2f}   ({trained} examples trained)")
    pe = {}
    for key in variants:
        ex, inc = med(key, "gradients") / a.n, med(key, "total") / a.n
        own = med(key, "method") / a.n
        ex_c, inc_c = med(key, "gradients_cpu") / a.n, med(key, "total_cpu") / a.n
        own_c = med(key, "method_cpu") / a.n
        pe[key] = (ex / train_pe, own / train_pe, inc / train_pe,
                   ex_c / train_cpu, own_c / train_cpu, inc_c / train_cpu)
        print(f"{'score ' + key + ', gradients':<32}{med(key, 'gradients'):>9.2f}"
              f"{1e3 * ex:>12.2f}{1e3 * ex_c:>11.2f}")
        print(f"{'score ' + key + ', method':<32}{med(key, 'method'):>9.2f}"
              f"{1e3 * own:>12.2f}{1e3 * own_c:>11.2f}   (warm-up steps + gradients)")
        print(f"{'score ' + key + ', with warm-up':<32}{med(key, 'total'):>9.2f}"
              f"{1e3 * inc:>12.2f}{1e3 * inc_c:>11.2f}   (warm-up {med(key, 'warmup'):.2f} s: "
              f"{runs[key][0]['steps']} steps + loss passes {med(key, 'losses'):.2f} s; "
              f"LoRA D={runs[key][0]['lora_dim']})")
    lp = {sparse: statistics.median(v) for sparse, v in loss_pass.items()}
    for sparse, label in ((True, "label-only head"), (False, "full logits")):
        print(f"{'one loss pass, ' + label:<32}{lp[sparse]:>9.2f}{1e3 * lp[sparse] / a.n:>12.2f}"
              f"   (the warm-up makes {score_cfg.get('loss_points', 5)}: S2L's trajectories)")
    print(f"\ntotal {time.perf_counter() - t_start:.1f}s")
    print(f"loss pass, full logits / label-only head: {lp[False] / lp[True]:.2f}x; stage with "
          f"warm-up, dense-full / dense: {med('dense-full', 'total') / med('dense', 'total'):.2f}x")
    print("ratios, score / train step, per example (target <= 1.5x): gradient pass; method "
          "(warm-up steps + gradient pass); whole stage (with S2L's loss passes). Wall, then "
          "CPU seconds (the process's: steadier where other jobs share the cores):")
    for key in variants:
        ex, own, inc, ex_c, own_c, inc_c = pe[key]
        print(f"  {key:<10} wall: gradients {ex:.2f}x  method {own:.2f}x  stage {inc:.2f}x | "
              f"cpu: gradients {ex_c:.2f}x  method {own_c:.2f}x  stage {inc_c:.2f}x")


if __name__ == "__main__":
    main()
