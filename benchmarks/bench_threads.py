"""Base-model pretraining and practice at 1 thread vs 2: why ``base_model`` asks for 2.

The ``base_model`` rule is the one job of the embedded default that runs alone (every other
job waits for its model), so the cores it leaves idle are lost. This times the stage's own
code paths, ``clusterft.modeling.pretrain.pretrain`` (packed blocks, AdamW) and
``clusterft.stages.models.practice`` (the practice ciphers through the train stage's one-rank
recipe), on models of config/config.yaml's ``models.<size>.size`` (a freshly built Llama and
a BPE tokenizer trained on a synthetic corpus: the step's cost does not depend on what the
weights have learnt), at each ``--threads`` count, interleaved over ``--repeats`` (each
timed as its best, so machine load hits them alike), and prints seconds per step and the
ratio of 1 thread to each other count last.

    python benchmarks/bench_threads.py [--sizes small,large] [--threads 1,2] [--steps 40]
        [--practice-steps 60] [--repeats 3]
    python benchmarks/bench_threads.py --smoke   (a tiny model, seconds)

The figures belong to the machine (benchmarks/README.md names it): a second thread helps
where one step's matrices are large enough to split (pretraining's 16 blocks of 128 tokens)
and less on practice's steps of 8 short examples.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))

import numpy as np  # noqa: E402

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2}


def corpus(n: int, seed: int = 0) -> list[str]:
    """Synthetic documents of ~60 words over a 500-word vocabulary (enough blocks for the
    steps timed; what they say does not change a step's cost)."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(500)]
    return [" ".join(rng.choice(words, 60)) for _ in range(n)]


def config_sizes() -> dict:
    import yaml

    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    return {name: m["size"] for name, m in cfg["models"].items() if isinstance(m.get("size"), dict)}


def time_pretrain(tok, size: dict, docs: list[str], steps: int, threads: int) -> float:
    import torch

    from clusterft.modeling.pretrain import pretrain
    from clusterft.stages.models import build_model

    torch.set_num_threads(threads)
    model = build_model(tok, size, seed=0)
    m = pretrain(model, tok, docs, {"steps": steps, "checkpoint_every": 0, "warmup_steps": 2})
    return m["train_seconds"] / steps


def time_practice(tok, size: dict, steps: int, threads: int) -> float:
    import torch

    from clusterft.stages.models import PRACTICE_DEFAULTS, build_model, practice

    torch.set_num_threads(threads)
    model = build_model(tok, size, seed=0)
    t0 = time.perf_counter()
    import warnings

    with warnings.catch_warnings():  # a few steps do not learn the lookup: not the point
        warnings.simplefilter("ignore")
        # one attempt (a few steps never pass min_exact, and a retry would time it again);
        # the figure includes one scoring of the held-out practice items, as the stage does
        practice(model, tok, {**PRACTICE_DEFAULTS, "steps": steps, "attempts": 1}, seed=0)
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="small,large",
                    help="names in config/config.yaml's models (their `size`)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=40, help="pretraining steps timed per run")
    ap.add_argument("--practice-steps", type=int, default=60,
                    help="practice steps timed per run (0: skip practice)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, few steps")
    args = ap.parse_args(argv)

    import logging
    import tempfile

    import torch

    from clusterft.modeling import cpu_matmul
    from clusterft.stages.models import train_tokenizer

    logging.basicConfig(level=logging.WARNING)
    kernel = cpu_matmul.from_env()  # as base_model does (CLUSTERFT_CPU_MATMUL, default auto)
    threads = [int(t) for t in args.threads.split(",")]
    if args.smoke:
        sizes, steps, psteps, repeats = {"tiny": TINY}, 3, 3, 1
    else:
        known = config_sizes()
        sizes = {s: known[s] for s in args.sizes.split(",")}
        steps, psteps, repeats = args.steps, args.practice_steps, args.repeats
    docs = corpus(400)
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        tok = train_tokenizer(docs, 2048, Path(tmp) / "tok")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, CPU matmul {kernel}; "
          f"pretraining {steps} steps, "
          f"practice {psteps} steps, best of {repeats}", flush=True)
    best: dict = {}
    for _ in range(repeats):
        for name, size in sizes.items():
            for t in threads:
                key = (name, "pretrain", t)
                best[key] = min(best.get(key, np.inf), time_pretrain(tok, size, docs, steps, t))
                if psteps:
                    key = (name, "practice", t)
                    best[key] = min(best.get(key, np.inf), time_practice(tok, size, psteps, t))
    for (name, part, t), s in sorted(best.items()):
        print(f"{name:6s} {part:9s} {t} thread(s): {s:.4f} s/step")
    print("ratios (s/step on 1 thread / on N threads):")
    for name in sizes:
        for part in ("pretrain", "practice") if psteps else ("pretrain",):
            one = best.get((name, part, 1))
            cells = [f"{t} threads {one / best[(name, part, t)]:.2f}x" for t in threads
                     if t != 1 and one is not None]
            print(f"  {name} {part}: {', '.join(cells) or 'no 1-thread run'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
