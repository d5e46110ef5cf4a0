"""What token balancing buys on GPUs: a per-step cost model fed with the sampler's real plans.

On the 2 shared CPU cores of the build machine the balanced sampler's wall-time effect is
noise, so its value on GPUs is predicted here instead, from a model stated in full:

    step time = max over ranks (padded tokens of the rank's step) x seconds per token
                + a fixed per-step cost

A data-parallel step ends when its slowest rank's backward ends (DDP's all-reduce waits for
every rank), and a rank's work grows with the tokens it processes, padding included. The
padded tokens are those train itself processes: each rank's step batch is the one
``clusterft.sampler.make_sampler`` + ``epoch_batches`` deal it (the same calls as
``clusterft.stages.train.train_loop``), cut into length-grouped micro-batches by
``clusterft.modeling.microbatch.plan_micro_batches`` and padded per group (``group_cost_tokens``,
``pad_to_multiple_of``), exactly as ``backward_step`` counts them.

Assumptions (each overridable; the numbers are assumptions, not measurements):

* Work per token is linear in the parameter count N: training ``6 N`` FLOPs per token for
  full fine-tuning (forward 2N, backward 4N; Kaplan et al. 2020), ``4 N`` for LoRA (the
  frozen weights need no weight gradient, so the backward is ~2N; the adapters' own work
  is negligible at rank 8-64), ``2 N`` for a forward pass (scoring losses, embeddings,
  evaluation); gradient checkpointing adds one more forward (2N) to training. Attention's quadratic term is left out (under 10% of the work for a 7B
  model below ~2k tokens).
* A GPU runs at ``DEFAULT_MFU`` = 0.30 of its peak dense bf16 throughput, and the default
  GPU is an H100 SXM, 989e12 bf16 FLOP/s dense (NVIDIA's datasheet). 0.30 sits between
  what tuned pretraining stacks report (0.4-0.5) and what plain Hugging Face LoRA
  fine-tuning gets; at the defaults a 7B LoRA step costs 4 x 6.74e9 / (0.30 x 989e12)
  = 9.1e-5 s per token (~11k tokens/s per GPU). ``benchmarks/bench_gpu_token_cost.py``
  measures the per-token cost and the fixed per-step cost on a real GPU.
* The fixed per-step cost (optimizer step, gradient all-reduce of the adapters, launch
  latency) is ``DEFAULT_STEP_OVERHEAD_S`` = 0.05 s.
* Ranks are otherwise identical (no stragglers, no data-loader stalls), so the ratio of
  two distributions' predicted times depends only on their plans and on the ratio of the
  fixed to the per-token cost.

The balanced sampler is not slower than random by construction (each step's deal is a
heuristic, and it balances real, not padded, tokens), so ``compare_distributions`` reports
what the plans give rather than assuming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clusterft.pipeline.names import BALANCED, RANDOM_SPLIT

__all__ = ["COPY_BYTES_PER_SECOND", "CostModel", "DEFAULT_MFU", "DEFAULT_STEP_OVERHEAD_S",
           "DRAWS_PER_SECOND", "H100_BF16_FLOPS", "KMEANS_SECONDS", "KNOWN_CONFIGS",
           "KNOWN_PARAMS", "NUMPY_KMEANS_FACTOR", "compare_distributions", "flops_per_token",
           "kmeans_seconds", "lora_matrices", "projection_work", "rank_padded_tokens",
           "token_plan"]

H100_BF16_FLOPS = 989e12        # H100 SXM5, dense bf16 tensor-core peak (NVIDIA datasheet)
DEFAULT_MFU = 0.30              # assumed model FLOPs utilisation (see the module docstring)
DEFAULT_STEP_OVERHEAD_S = 0.05  # assumed fixed cost per optimiser step
# Parameter counts of hub models the paper config names (their model cards / configs).
KNOWN_PARAMS = {
    "meta-llama/Llama-2-7b-hf": 6.74e9,
    "meta-llama/Llama-2-13b-hf": 13.02e9,
}
# Their architectures (config.json), for LoRA's shapes: the projection's cost and an
# adapter's size.
KNOWN_CONFIGS = {
    "meta-llama/Llama-2-7b-hf": {"hidden_size": 4096, "num_hidden_layers": 32,
                                 "intermediate_size": 11008, "vocab_size": 32000,
                                 "num_attention_heads": 32, "num_key_value_heads": 32,
                                 "max_position_embeddings": 4096},
    "meta-llama/Llama-2-13b-hf": {"hidden_size": 5120, "num_hidden_layers": 40,
                                  "intermediate_size": 13824, "vocab_size": 32000,
                                  "num_attention_heads": 40, "num_key_value_heads": 40,
                                  "max_position_embeddings": 4096},
}
_FLOPS_PER_PARAM = {"full": 6.0, "lora": 4.0, "forward": 2.0}
# Seeded draws per second of a dense projection matrix's entries on one GPU (our assumption:
# generation is bound by memory bandwidth, ~1 TB/s of float32 writes, not by tensor cores).
# The dense projector regenerates its D x dim matrix, chunk by chunk, for every batch of the
# gradient pass, so at LoRA D ~ 1e8 and dim 8192 the draws, not the product, dominate.
DRAWS_PER_SECOND = 2.5e11
# CPU work of the rules without a GPU, for their runtimes (clusterft.plan.resources).
# k-means: seconds per row x column x centroid x iteration of faiss's spherical k-means on
# one core (measured, benchmarks/README.md "Clustering backends": 10^5 x 1024 rows, k 64,
# 25 iterations in 5.57 s on an AMD EPYC core, 3.4e-11; 10^6 x 256: 3.3e-11). faiss runs
# every iteration of every restart; the numpy reference stops early but was 5.8-8.9x slower
# per iteration at 10^5 rows, so it gets the upper factor.
KMEANS_SECONDS = 3.4e-11
NUMPY_KMEANS_FACTOR = 9.0
# Bytes per second a job reads or writes model weights at on a shared file system (our
# assumption: a busy NFS/Lustre client).
COPY_BYTES_PER_SECOND = 2e8


def kmeans_seconds(n: int, dim: int, k: int, max_iter: int, n_init: int,
                   backend: str = "faiss") -> float:
    """One core's seconds of cosine k-means over ``n`` x ``dim`` features: every iteration of
    every restart (KMEANS_SECONDS; the numpy reference NUMPY_KMEANS_FACTOR times slower)."""
    factor = NUMPY_KMEANS_FACTOR if backend == "numpy" else 1.0
    return float(n) * dim * k * max_iter * n_init * KMEANS_SECONDS * factor


def flops_per_token(params: float, kind: str = "lora", recompute: bool = False) -> float:
    """FLOPs per token for ``kind``: full (6N), lora (4N) or forward (2N); ``recompute``
    (train.gradient_checkpointing) adds the forward pass again (2N) to a training kind."""
    if kind not in _FLOPS_PER_PARAM:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(_FLOPS_PER_PARAM)}")
    if not params > 0:
        raise ValueError(f"params must be > 0, got {params!r}")
    extra = 2.0 if recompute and kind != "forward" else 0.0
    return (_FLOPS_PER_PARAM[kind] + extra) * float(params)


def lora_matrices(config: dict, lora: dict) -> list[tuple[int, int]]:
    """(inputs, outputs) of every LoRA matrix (A: d_in -> r, B: r -> d_out) of a Llama-shaped
    model with adapters on ``lora['target_modules']`` in every layer."""
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config.get("num_attention_heads") or 1)
    kv = h * int(config.get("num_key_value_heads") or heads) // heads
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    r, out = int(lora["r"]), []
    for name in lora["target_modules"]:
        if name not in shapes:
            raise ValueError(f"LoRA target {name!r} is not a Llama projection ({', '.join(shapes)})")
        d_in, d_out = shapes[name]
        out += [(d_in, r), (r, d_out)] * int(config["num_hidden_layers"])
    return out


def projection_work(matrices: list[tuple[int, int]], dim: int, projection: str,
                    tokens: float, examples: float, batches: float) -> tuple[float, float]:
    """(FLOPs, matrix draws) of projecting per-example LoRA gradients to ``dim`` columns, for
    ``examples`` examples of ``tokens`` tokens in all, in ``batches`` batches (one pass).

    dense (rademacher, gaussian): each example's flattened gradient (D = sum of matrix sizes)
    times a D x dim matrix, 2 D dim FLOPs, and the matrix's D x dim draws for every batch.
    kronecker (LoGra): per matrix, the layer input (d_in) and output gradient (d_out) of
    every token are projected to k_in x k_out = dim / matrices entries (k its square root),
    2 (d_in + d_out) k FLOPs per token plus the outer product; no D-vector, no draws beyond
    the small factors."""
    d = sum(i * o for i, o in matrices)
    if projection == "kronecker":
        k = math.sqrt(max(1.0, dim / max(1, len(matrices))))
        per_token = sum(2 * (i + o) * k + k * k for i, o in matrices)
        return float(per_token * tokens), 0.0
    return float(2.0 * d * dim * examples), float(d * dim * batches)


@dataclass(frozen=True)
class CostModel:
    """Seconds per (padded) token on one GPU and a fixed cost per optimiser step."""

    seconds_per_token: float
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        if not self.seconds_per_token > 0 or not self.step_overhead_s >= 0:
            raise ValueError(f"need seconds_per_token > 0 and step_overhead_s >= 0, got "
                             f"{self.seconds_per_token!r}, {self.step_overhead_s!r}")

    @classmethod
    def from_params(cls, params: float, kind: str = "lora", peak_flops: float = H100_BF16_FLOPS,
                    mfu: float = DEFAULT_MFU,
                    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S) -> "CostModel":
        """The documented default for a model of ``params`` parameters."""
        if not 0 < mfu <= 1 or not peak_flops > 0:
            raise ValueError(f"need 0 < mfu <= 1 and peak_flops > 0, got {mfu!r}, {peak_flops!r}")
        return cls(flops_per_token(params, kind) / (peak_flops * mfu), step_overhead_s)

    def step_times(self, padded: np.ndarray) -> np.ndarray:
        """Seconds of each step of a plan ``[steps, ranks]`` of padded tokens."""
        padded = np.asarray(padded, dtype=np.float64)
        if padded.ndim != 2:
            raise ValueError(f"a token plan is [steps, ranks], got shape {padded.shape}")
        return padded.max(axis=1) * self.seconds_per_token + self.step_overhead_s

    def run_time(self, padded: np.ndarray) -> float:
        """Seconds of a whole plan ``[steps, ranks]``."""
        return float(self.step_times(padded).sum())


def rank_padded_tokens(lengths: Sequence[int], group_cost_tokens: float = -1,
                       pad_to_multiple_of: int = 1) -> int:
    """Tokens one rank processes for one step's batch, padding included, as train's
    ``backward_step`` counts them (length-grouped micro-batches; -1: one padded batch)."""
    from clusterft.modeling.microbatch import padded_size, plan_micro_batches

    lengths = [int(x) for x in lengths]
    if not lengths:
        return 0
    groups = plan_micro_batches(lengths, group_cost_tokens, pad_to_multiple_of)
    return padded_size(lengths, groups, pad_to_multiple_of)


def token_plan(distribution: str, clusters: np.ndarray, lengths: np.ndarray, world_size: int,
               batch_size: int, seed: int = 0, epochs: int = 1, drop_last: bool = False,
               group_cost_tokens: float = -1, pad_to_multiple_of: int = 1
               ) -> tuple[np.ndarray, np.ndarray]:
    """(padded, real) tokens per step and rank, ``[steps, world_size]`` each, of ``epochs``
    epochs dealt by the sampler train uses for ``distribution`` (random | balanced)."""
    from clusterft.sampler import epoch_batches, make_sampler

    lengths = np.asarray(lengths, dtype=np.int64)
    clusters = np.asarray(clusters)
    if len(lengths) != len(clusters) or len(lengths) == 0:
        raise ValueError(f"need one cluster per length and at least one example, got "
                         f"{len(clusters)} clusters and {len(lengths)} lengths")
    sampler = make_sampler(distribution, clusters, lengths, world_size, 0, batch_size, seed,
                           drop_last)
    padded, real = [], []
    for epoch in range(epochs):
        per_rank = []
        for r in range(world_size):
            sampler.rank = r  # both samplers read .rank when iterated; the plan is shared
            per_rank.append(epoch_batches(sampler, epoch, batch_size))
        steps = len(per_rank[0])
        if any(len(b) != steps for b in per_rank):
            raise RuntimeError(f"ranks got different step counts: {[len(b) for b in per_rank]}")
        for s in range(steps):
            padded.append([rank_padded_tokens(lengths[per_rank[r][s]], group_cost_tokens,
                                              pad_to_multiple_of) for r in range(world_size)])
            real.append([int(lengths[per_rank[r][s]].sum()) for r in range(world_size)])
    return (np.asarray(padded, dtype=np.int64).reshape(-1, world_size),
            np.asarray(real, dtype=np.int64).reshape(-1, world_size))


def compare_distributions(clusters: np.ndarray, lengths: np.ndarray, model: CostModel,
                          gpus: Sequence[int] = (4, 8), global_batch_size: int = 64,
                          seed: int = 0, epochs: int = 1, group_cost_tokens: float = -1,
                          pad_to_multiple_of: int = 1) -> list[dict]:
    """Predicted train time of random vs balanced at each GPU count, one row per count:
    seconds of each, their ratio (balanced / random; < 1: balancing saves time) and the
    mean per-step max/mean of real and of padded tokens over ranks."""
    rows = []
    for g in gpus:
        if global_batch_size % g:
            raise ValueError(f"global_batch_size {global_batch_size} does not split over {g} GPUs")
        row: dict = {"gpus": int(g)}
        for dist in (RANDOM_SPLIT, BALANCED):
            padded, real = token_plan(dist, clusters, lengths, g, global_batch_size // g, seed,
                                      epochs, False, group_cost_tokens, pad_to_multiple_of)
            row[f"{dist}_s"] = model.run_time(padded)
            row[f"{dist}_max_mean"] = float(np.mean(real.max(1) / np.maximum(real.mean(1), 1e-9)))
            row[f"{dist}_padded_max_mean"] = float(
                np.mean(padded.max(1) / np.maximum(padded.mean(1), 1e-9)))
            row["steps"] = len(padded)
        row["ratio"] = row["balanced_s"] / row["random_s"]
        rows.append(row)
    return rows


def _main(argv: list[str] | None = None) -> int:
    """Random vs balanced predicted train time on a seeded log-normal, Zipf-clustered pool."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m clusterft.analysis.costmodel", description=_main.__doc__,
                                 allow_abbrev=False)
    ap.add_argument("--n", type=int, default=20000, help="examples in the pool")
    ap.add_argument("--clusters", type=int, default=64, help="Zipf-sized clusters (default 64)")
    ap.add_argument("--mean-tokens", type=float, default=300.0, help="mean example length in tokens")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of lengths")
    ap.add_argument("--max-length", type=int, default=0,
                    help="cut lengths here, as train's truncation does (0: no cut)")
    ap.add_argument("--params", type=float, default=KNOWN_PARAMS["meta-llama/Llama-2-7b-hf"],
                    help="model parameters (default: Llama-2-7B's)")
    ap.add_argument("--kind", default="lora", choices=sorted(_FLOPS_PER_PARAM),
                    help="fine-tuning kind, for FLOPs per token (default lora)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilisation assumed")
    ap.add_argument("--seconds-per-token", type=float, help="overrides --params/--kind/--mfu")
    ap.add_argument("--step-overhead", type=float, default=DEFAULT_STEP_OVERHEAD_S,
                    help="fixed seconds per optimiser step (all-reduce, launch)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 8], help="GPU counts to compare")
    ap.add_argument("--global-batch-size", type=int, default=64, help="examples per optimiser step")
    ap.add_argument("--group-cost-tokens", type=float, default=2048,
                    help="micro-batch fixed cost in tokens (length grouping)")
    ap.add_argument("--pad-to-multiple-of", type=int, default=8, help="padding granularity")
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulated pool")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    w = 1.0 / np.arange(1, a.clusters + 1)
    cl = rng.choice(a.clusters, size=a.n, p=w / w.sum())
    mu = np.log(a.mean_tokens) - a.sigma ** 2 / 2
    ln = np.maximum(1, np.round(rng.lognormal(mu, a.sigma, a.n))).astype(np.int64)
    if a.max_length > 0:
        ln = np.minimum(ln, a.max_length)
    model = (CostModel(a.seconds_per_token, a.step_overhead) if a.seconds_per_token else
             CostModel.from_params(a.params, a.kind, mfu=a.mfu, step_overhead_s=a.step_overhead))
    print(f"pool {a.n} examples, mean {ln.mean():.0f} tokens; {model.seconds_per_token:.3g} s "
          f"per token + {model.step_overhead_s:g} s per step")
    for r in compare_distributions(cl, ln, model, a.gpus, a.global_batch_size, a.seed, 1,
                                   a.group_cost_tokens, a.pad_to_multiple_of):
        print(f"{r['gpus']} GPUs, {r['steps']} steps: random {r['random_s']:.1f} s, balanced "
              f"{r['balanced_s']:.1f} s; padded max/mean {r['random_padded_max_mean']:.3f} vs "
              f"{r['balanced_padded_max_mean']:.3f}; ratio balanced/random {r['ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
