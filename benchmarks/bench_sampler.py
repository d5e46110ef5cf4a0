"""Benchmark: ClusterBalancedSampler plan time vs. one training step, and token-load balance.

Builds a pool (default 50k examples, 20 Zipf-sized clusters, log-normal lengths), times one
epoch's global plan, and times a training step (forward + backward + AdamW) of a tiny Llama
(batch 16 x 128 tokens) in the same run, then prints plan time per step / train step time.
It also prints the mean and 95th percentile over steps of the per-step token-load max/mean
for the balanced sampler and for torch's DistributedSampler (shuffle) on the same pool.

    python benchmarks/bench_sampler.py [--n 50000] [--clusters 20] [--replicas 4]
        [--batch-size 16] [--seq-len 128] [--threads 1] [--device cpu]

Runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import time

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from clusterft.sampler import ClusterBalancedSampler  # noqa: E402


def make_pool(n: int, clusters: int, sigma: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Zipf-sized clusters (cluster k has weight 1/k) and log-normal token lengths."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, clusters + 1)
    cid = rng.choice(clusters, size=n, p=w / w.sum())
    lengths = np.maximum(1, np.round(rng.lognormal(5.0, sigma, n))).astype(np.int64)
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


def time_plan(cid, lengths, replicas, batch, seed, epochs=3) -> tuple[float, int]:
    """Seconds to build one epoch's plan (median of ``epochs`` fresh epochs), steps/epoch."""
    s = ClusterBalancedSampler(cid, lengths, replicas, 0, batch, seed=seed)
    times = []
    for e in range(epochs):
        t = time.perf_counter()
        s.global_plan(e)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), s.steps_per_epoch


def time_train_step(batch: int, seq_len: int, device: str = "cpu", steps: int = 8,
                    warmup: int = 2) -> float:
    """Seconds per forward/backward/AdamW step of a ~0.6M-parameter Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=seq_len, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of lengths")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the train step (1 is steadiest on a shared machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="device for the train step (cpu, cuda)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    cid, lengths = make_pool(a.n, a.clusters, a.sigma, a.seed)
    plan_s, steps = time_plan(cid, lengths, a.replicas, a.batch_size, a.seed)
    step_s = time_train_step(a.batch_size, a.seq_len, a.device)
    per_step = plan_s / steps
    print(f"pool: {a.n} examples, {a.clusters} Zipf clusters, log-normal lengths "
          f"(sigma {a.sigma}); {a.replicas} ranks x batch {a.batch_size} = {steps} steps/epoch")
    print(f"plan build, one epoch      : {plan_s * 1e3:9.1f} ms")
    print(f"plan build per step        : {per_step * 1e3:9.3f} ms")
    where = f"{a.threads} threads" if a.device == "cpu" else a.device
    print(f"train step (tiny Llama, {a.batch_size}x{a.seq_len}, {where}): "
          f"{step_s * 1e3:.1f} ms")
    print(f"ratio plan-per-step / train-step: {per_step / step_s:.4f} "
          f"({100 * per_step / step_s:.2f}%)")

    print("\ntoken load per step, max/mean over ranks (mean | p95 over steps):")
    for B in sorted({a.batch_size, 4, 1}, reverse=True):
        ours = load_ratios(ClusterBalancedSampler(cid, lengths, a.replicas, 0, B, seed=a.seed)
                           .global_plan(0), lengths)
        ref = np.concatenate([load_ratios(distributed_plan(a.n, a.replicas, B, s), lengths)
                              for s in range(2)])
        ratio = (ours.mean() - 1) / (ref.mean() - 1)
        print(f"  batch {B:3d}: ClusterBalancedSampler {ours.mean():.4f} | "
              f"{np.percentile(ours, 95):.4f}   DistributedSampler {ref.mean():.4f} | "
              f"{np.percentile(ref, 95):.4f}   (excess ratio {ratio:.3f})")


if __name__ == "__main__":
    main()
