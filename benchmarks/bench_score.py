"""Benchmark per-example LoRA gradients: hook vs torch.func vs a batch-size-1 loop.

Default run (well under a minute on 2 CPU cores): a randomly initialised Llama (hidden
128, intermediate 256, 2 layers, 4 heads, vocab 2048), peft LoRA r=8 on q/k/v/o, one batch
of 32 right-padded examples of 33-64 tokens (16 prompt tokens without loss). Prints the
seconds per batch of each method side by side, the speed-up over the loop, and each
method's agreement with the loop (minimum cosine over the batch). Times are the best of
``--repeats`` runs; on a machine shared with other jobs use ``--threads 1`` (two torch
threads competing with other processes for two cores slow every method down several-fold
and unevenly).

``--end-to-end N`` also times ``clusterft.stages.score.compute_features`` (warm-up + gradients +
projection) on N synthetic examples for the ``small`` and ``large`` model sizes of
``clusterft.stages.models.DEFAULTS`` (or ``--sizes``), and extrapolates to ``--target`` examples.

    python benchmarks/bench_score.py [--repeats 4] [--threads 0] [--end-to-end 300]
    python benchmarks/bench_score.py --smoke   (tiny sizes in seconds: a check that it runs)

The ratios (each method's speed-up over the loop) are printed last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def tiny_lora_llama(hidden=128, inter=256, layers=2, heads=4, vocab=2048, r=8, seed=0,
                    attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from clusterft.modeling.lora import DEFAULTS as LORA
    from clusterft.modeling.lora import add_lora

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, tie_word_embeddings=True, pad_token_id=2,
                      max_position_embeddings=512, attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    pm = add_lora(model, {**LORA, "r": r, "alpha": 2 * r, "dropout": 0.0}, "score.lora", seed=seed)
    with torch.no_grad():  # as after a warm-up: lora_B != 0, so lora_A gradients are live
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
    pm.eval()
    return pm


def random_batch(n=32, max_len=64, prompt=16, vocab=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 2 + 1, max_len + 1, (n,), generator=g)
    lengths[0] = max_len
    ids = torch.full((n, max_len), 2, dtype=torch.long)
    labels = torch.full((n, max_len), -100, dtype=torch.long)
    mask = torch.zeros((n, max_len), dtype=torch.long)
    for i, k in enumerate(lengths.tolist()):
        ids[i, :k] = torch.randint(3, vocab, (k,), generator=g)
        labels[i, prompt:k] = ids[i, prompt:k]
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def time_it(fn, repeats):
    """Best of ``repeats`` runs: the least disturbed by other processes on a shared machine."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


SMOKE = {"model": {"hidden": 32, "inter": 64, "layers": 1, "heads": 2, "vocab": 256, "r": 4},
         "batch": {"n": 8, "max_len": 24, "prompt": 8, "vocab": 256}}


def bench_grads(repeats: int, smoke: bool = False) -> list[tuple[str, float]]:
    """Print the methods' table; return (method, speed-up over the loop) pairs."""
    from clusterft.stages.score import per_example_grads

    mk, bk = (SMOKE["model"], SMOKE["batch"]) if smoke else ({}, {})
    batch = random_batch(**bk)
    models = {"sdpa": tiny_lora_llama(attn="sdpa", **mk),
              "eager": tiny_lora_llama(attn="eager", **mk)}
    d = sum(p.numel() for p in models["sdpa"].parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in models["sdpa"].parameters())
    print(f"Llama {n_params / 1e6:.2f}M params, LoRA D={d}, batch {tuple(batch['input_ids'].shape)}, "
          f"torch threads {torch.get_num_threads()}, best of {repeats} runs")
    for m in models.values():  # first-call costs (allocator, kernels) out of every timing
        per_example_grads(m, batch, "hook")
    rows = []
    ref = None
    for label, attn, method in (("loop (bs=1)", "sdpa", "loop"), ("hook", "sdpa", "hook"),
                                ("func (sdpa)", "sdpa", "func"), ("func (eager attn)", "eager", "func"),
                                ("hook (eager attn)", "eager", "hook")):
        m = models[attn]
        sec, g = time_it(lambda m=m, method=method: per_example_grads(m, batch, method), repeats)
        if ref is None:
            ref = g
        cos = torch.nn.functional.cosine_similarity(g, ref, dim=1).min().item()
        rows.append((label, sec, cos))
    loop = rows[0][1]
    n = batch["input_ids"].shape[0]
    print(f"{'method':<20}{'s/batch':>10}{'ex/s':>10}{'vs loop':>10}{'min cos':>12}")
    for label, sec, cos in rows:
        print(f"{label:<20}{sec:>10.3f}{n / sec:>10.1f}{loop / sec:>9.2f}x{cos:>12.7f}")
    return [(label, loop / sec) for label, sec, _ in rows[1:]]


def tokenizer_texts() -> list[str]:
    """The score stage's own source (every file of its package), three times: local text of
    the size the benchmarks' tokenizers were trained on when the stage was one file."""
    from clusterft.stages import score

    files = sorted(Path(score.__file__).parent.glob("*.py"))
    return [line for f in files for line in f.read_text(encoding="utf-8").splitlines(True)] * 3


def synthetic_pool(n: int, seed: int = 0) -> list[dict]:
    """Instruction/response pairs of roughly 60-100 tokens with the project's prompt format."""
    import random

    rnd = random.Random(seed)
    words = ("list string integer return value function sorted reverse count number index "
             "element dictionary key loop print python code word letter sum result input "
             "output maximum minimum even odd first last length").split()
    pool = []
    for i in range(n):
        q = " ".join(rnd.choice(words) for _ in range(rnd.randint(14, 26)))
        a = " ".join(rnd.choice(words) for _ in range(rnd.randint(6, 18)))
        pool.append({"id": f"syn-{i}", "messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]})
    return pool


def bench_end_to_end(n: int, target: int, sizes: list[str]) -> None:
    import numpy as np

    from clusterft.stages import score
    from clusterft.stages.models import DEFAULTS as MODEL_DEFAULTS
    from clusterft.stages.models import build_model, count_params, train_tokenizer
    from clusterft.modeling.tokenize import encode_example

    tok = train_tokenizer(tokenizer_texts(), 2048, None, seed=0)
    pool = synthetic_pool(n)
    lengths = [encode_example(tok, r["messages"], 256)["length"] for r in pool]
    print(f"\nend to end: compute_features on {n} synthetic examples "
          f"(tokens: mean {np.mean(lengths):.0f}, min {min(lengths)}, max {max(lengths)}), "
          f"score DEFAULTS (torch threads: num_threads={score.DEFAULTS['num_threads']})")
    for size in sizes:
        model = build_model(tok, MODEL_DEFAULTS["sizes"][size], seed=0)
        t0 = time.perf_counter()
        _, _, _, info = score.compute_features_info(model, tok, pool, {}, seed=0)
        sec = time.perf_counter() - t0
        grad_s = sec - info["warmup_seconds"]
        # Warm-up steps grow with the pool (warmup_fraction x epochs), so both parts scale ~linearly.
        print(f"  {size:<6} {count_params(model) / 1e6:.2f}M params, LoRA D={info['lora_dim']}: "
              f"{sec:.1f}s ({info['warmup_steps']} warm-up steps {info['warmup_seconds']:.1f}s, "
              f"gradients {grad_s:.1f}s = {n / grad_s:.0f} ex/s) -> ~{sec * target / n:.0f}s "
              f"for {target} examples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--end-to-end", type=int, default=0, metavar="N",
                    help="also time compute_features on N synthetic examples")
    ap.add_argument("--target", type=int, default=3000, help="pool size to extrapolate to")
    ap.add_argument("--sizes", nargs="+", default=["small", "large"])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model and batch, 1 repeat, no end-to-end part (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.end_to_end = 1, 0
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    ratios = bench_grads(args.repeats, args.smoke)
    if args.end_to_end:
        bench_end_to_end(args.end_to_end, args.target, args.sizes)
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    print("ratios, speed-up over the batch-size-1 loop: "
          + ", ".join(f"{label} {r:.2f}x" for label, r in ratios))


if __name__ == "__main__":
    main()
