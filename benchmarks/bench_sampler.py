"""Benchmark: the balanced sampler against random and the field's balancing anchors.

One pool per run (``--n`` examples, ``--clusters`` Zipf-sized clusters, log-normal token
lengths whose median differs by cluster), dealt to 2, 4, 8 and 64 ranks (``--ranks``) with
``--batch-size`` examples per rank per step by four methods, side by side in one process:

* ``balanced``: ``ClusterBalancedSampler`` (``distribution: balanced``), each rank's batch
  padded into length-grouped micro-batches (``train.packing: false``);
* ``packed``: the same plan, each rank's batch packed into one row (``train.packing``, the
  default where exact: clusterft.modeling.packing), so no padding: its step cost is the
  heaviest rank's real tokens;
* ``random``: torch's ``DistributedSampler(shuffle=True)`` (``distribution: random``);
* ``kk``: verl-style, a random global batch split over ranks by equal-size Karmarkar-Karp;
* ``multipack``: axolotl-style, first-fit-decreasing packing of the upcoming examples into
  one bin per rank of a token budget (``--capacity-slack`` x the mean per-rank load of the
  others, at least the longest example); sequences packed, so no padding.

Both anchors are in ``benchmarks/balancing_anchors.py``. Per method and rank count:

* ``max/mean``: per step, the heaviest rank's real tokens over the mean rank's (mean and
  p95 over steps; the target for balanced is <= 1.02);
* ``pad``: padding fraction, (padded - real) / padded tokens, each rank's batch cut into
  length-grouped micro-batches and padded as train does (``--group-cost-tokens``, train's
  default 256; -1 pads the whole batch to its longest); 0 for multipack, which packs;
* ``step cost``: per step, the slowest rank's padded tokens over the mean real tokens per
  rank: what a step costs relative to a perfectly balanced, unpadded one (the quantity
  ``clusterft.analysis.costmodel`` turns into time);
* ``clusters``: distinct clusters per rank-batch (mean over rank-batches);
* ``us/index``: microseconds to plan one example (one epoch's plan over the pool / N).

The ratios come last: balanced's excess (max/mean - 1) and step cost over each other
method's, and its planning time per index over theirs. Without ``--smoke`` it also times a
tiny-Llama training step to put the plan time per step in proportion.

    python benchmarks/bench_sampler.py [--n 50000] [--clusters 20] [--ranks 2 4 8 64]
        [--batch-size 16] [--sigma 0.8] [--max-length 2048] [--group-cost-tokens 256]
        [--seed 0] [--smoke]

``--smoke`` runs tiny sizes in seconds (a check that the script works; figures mean little).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from balancing_anchors import kk_plan, multipack_plan  # noqa: E402
from clusterft.analysis.costmodel import rank_padded_tokens  # noqa: E402
from clusterft.sampler import ClusterBalancedSampler  # noqa: E402

METHODS = ("balanced", "packed", "random", "kk", "multipack")


def make_pool(n: int, clusters: int, sigma: float, seed: int, max_length: int = 2048,
              cluster_spread: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """Zipf-sized clusters (cluster k has weight 1/k) and log-normal token lengths, median
    ~150 tokens, each cluster's log-median shifted by N(0, ``cluster_spread``), cut at
    ``max_length`` (train truncates longer examples)."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, clusters + 1)
    cid = rng.choice(clusters, size=n, p=w / w.sum())
    shift = rng.normal(0.0, cluster_spread, clusters)
    lengths = np.clip(np.round(rng.lognormal(5.0 + shift[cid], sigma)), 1, max_length)
    lengths = lengths.astype(np.int64)
    return cid, lengths


def load_ratios(plan: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-step max/mean of the ranks' token loads; plan is [steps, replicas, batch]."""
    load = lengths[plan].sum(axis=2).astype(float)
    return load.max(axis=1) / load.mean(axis=1)


def distributed_plan(n: int, replicas: int, batch: int, seed: int) -> np.ndarray:
    """What DistributedSampler(shuffle=True) + DataLoader(batch) give, full steps only."""
    per_rank = [list(DistributedSampler(range(n), num_replicas=replicas, rank=r, shuffle=True,
                                        seed=seed)) for r in range(replicas)]
    steps = len(per_rank[0]) // batch
    return np.array([p[:steps * batch] for p in per_rank]).reshape(replicas, steps, batch
                                                                     ).transpose(1, 0, 2)


def plan_stats(steps: list[list[list[int]]], lengths: np.ndarray, cid: np.ndarray,
               packed: bool, group_cost_tokens: float = -1) -> dict:
    """max/mean, padding fraction, step cost and distinct clusters of a plan given as
    steps of per-rank index lists (empty ranks count as zero load). A rank's padded tokens
    are what train processes (``clusterft.analysis.costmodel.rank_padded_tokens``: length-grouped
    micro-batches at ``group_cost_tokens``; -1: one batch padded to its longest)."""
    ratios, costs, distinct = [], [], []
    real_sum = padded_sum = 0.0
    for step in steps:
        real = np.array([lengths[b].sum() if len(b) else 0 for b in step], dtype=float)
        padded = real if packed else np.array(
            [rank_padded_tokens(lengths[b], group_cost_tokens) for b in step], dtype=float)
        mean = real.mean()
        ratios.append(real.max() / mean)
        costs.append(padded.max() / mean)
        real_sum += real.sum()
        padded_sum += padded.sum()
        distinct += [len(np.unique(cid[b])) for b in step if len(b)]
    ratios, costs = np.asarray(ratios), np.asarray(costs)
    return {"max_mean": float(ratios.mean()), "max_mean_p95": float(np.percentile(ratios, 95)),
            "pad": 1.0 - real_sum / padded_sum, "step_cost": float(costs.mean()),
            "clusters": float(np.mean(distinct)), "steps": len(steps)}


def as_steps(plan: np.ndarray) -> list[list[list[int]]]:
    return [[list(r) for r in s] for s in plan.tolist()]


def run_method(method: str, cid: np.ndarray, lengths: np.ndarray, ranks: int, batch: int,
               seed: int, slack: float) -> tuple[list, float, bool]:
    """(steps, seconds to plan one epoch, packed) for one method."""
    n = len(lengths)
    t = time.perf_counter()
    if method in ("balanced", "packed"):
        plan = ClusterBalancedSampler(cid, lengths, ranks, 0, batch, seed=seed).global_plan(0)
        steps, packed = as_steps(plan), method == "packed"
    elif method == "random":
        steps, packed = as_steps(distributed_plan(n, ranks, batch, seed)), False
    elif method == "kk":
        order = np.random.default_rng(seed).permutation(n)
        steps, packed = as_steps(kk_plan(lengths, order, ranks, batch)), False
    elif method == "multipack":
        order = np.random.default_rng(seed).permutation(n)
        capacity = max(float(lengths.max()), slack * batch * float(lengths.mean()))
        steps, packed = multipack_plan(lengths, order, ranks, capacity), True
    else:
        raise ValueError(method)
    return steps, time.perf_counter() - t, packed


def time_train_step(batch: int, seq_len: int, steps: int = 8, warmup: int = 2) -> float:
    """Seconds per forward/backward/AdamW step of a ~0.6M-parameter Llama on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=seq_len, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 64])
    ap.add_argument("--batch-size", type=int, default=16, help="examples per rank per step")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of lengths")
    ap.add_argument("--max-length", type=int, default=2048,
                    help="lengths are cut here (train's truncation)")
    ap.add_argument("--group-cost-tokens", type=float, default=256,
                    help="train's micro-batch grouping for padded tokens (-1: one batch)")
    ap.add_argument("--capacity-slack", type=float, default=1.05,
                    help="multipack bin = this x batch-size x mean length tokens")
    ap.add_argument("--repeats", type=int, default=3, help="plan timings: median of this many")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.n, a.clusters, a.ranks, a.batch_size, a.repeats = 600, 6, [2, 4], 8, 1
    torch.set_num_threads(1)

    cid, lengths = make_pool(a.n, a.clusters, a.sigma, a.seed, a.max_length)
    print(f"pool: {a.n} examples, {a.clusters} Zipf clusters, log-normal lengths (sigma "
          f"{a.sigma}, mean {lengths.mean():.0f}, max {lengths.max()}); batch {a.batch_size} "
          f"per rank; padded tokens as train counts them (group_cost_tokens "
          f"{a.group_cost_tokens:g})")
    print(f"{'ranks':>5} {'method':>10} {'steps':>6} {'max/mean':>9} {'p95':>7} {'pad':>6} "
          f"{'step cost':>9} {'clusters':>8} {'us/index':>9}")
    res: dict = {}
    for R in a.ranks:
        if a.n < R * a.batch_size:
            print(f"{R:5d}  skipped: fewer than {R * a.batch_size} examples")
            continue
        for m in METHODS:
            times = []
            for _ in range(a.repeats):
                steps, secs, packed = run_method(m, cid, lengths, R, a.batch_size, a.seed,
                                                 a.capacity_slack)
                times.append(secs)
            st = plan_stats(steps, lengths, cid, packed, a.group_cost_tokens)
            st["us_index"] = 1e6 * float(np.median(times)) / a.n
            res[R, m] = st
            print(f"{R:5d} {m:>10} {st['steps']:6d} {st['max_mean']:9.4f} "
                  f"{st['max_mean_p95']:7.4f} {st['pad']:6.3f} {st['step_cost']:9.4f} "
                  f"{st['clusters']:8.2f} {st['us_index']:9.2f}")

    if not a.smoke:
        R0 = a.ranks[0]
        step_s = time_train_step(a.batch_size, 128)
        plan_step = res[R0, "balanced"]["us_index"] * 1e-6 * R0 * a.batch_size
        print(f"\nbalanced plan per step at {R0} ranks: {plan_step * 1e3:.3f} ms; tiny-Llama "
              f"train step ({a.batch_size}x128, 1 thread): {step_s * 1e3:.1f} ms "
              f"({100 * plan_step / step_s:.2f}%)")

    print("\nratios (balanced / other; excess = max/mean - 1; < 1x: balanced better or faster):")
    for R in a.ranks:  # the packed rows against the packing anchor
        if (R, "packed") in res:
            p, mp = res[R, "packed"], res[R, "multipack"]
            print(f"  {R:3d} ranks: packed balanced / multipack: step cost "
                  f"{p['step_cost'] / mp['step_cost']:.3f}x, max/mean {p['max_mean']:.4f} vs "
                  f"{mp['max_mean']:.4f}, clusters per rank-batch {p['clusters']:.2f} vs "
                  f"{mp['clusters']:.2f}")
    for R in a.ranks:
        if (R, "balanced") not in res:
            continue
        b = res[R, "balanced"]
        parts = []
        for m in METHODS[2:]:
            o = res[R, m]
            exc = (b["max_mean"] - 1) / max(o["max_mean"] - 1, 1e-12)
            cost = b["step_cost"] / o["step_cost"]
            parts.append(f"vs {m}: excess {exc:.3f}x, step cost {cost:.3f}x, "
                         f"us/index {b['us_index'] / o['us_index']:.2f}x")
        print(f"  {R:3d} ranks: " + "; ".join(parts))
    return res


if __name__ == "__main__":
    main()
