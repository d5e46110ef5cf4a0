"""Benchmark one training step: plain padded batch vs length-grouped micro-batches, the
label-only LM head (clusterft.modeling.microbatch) and packed rows (clusterft.modeling.packing),
side by side in one run.

Each variant runs forward + backward on the same step batches (``--batch`` examples,
per rank) and is timed as the best of ``--repeats`` passes over ``--steps`` batches; it
prints seconds per step, the ratio to the plain step, padded tokens per step, and the
largest gradient difference from the plain step (the rewrites are exact, so this is
float noise; bf16 autocast, run where the CPU has native bf16, is not exact). The bf16 row is
one process; benchmarks/README.md records what it and the other rows gave, and under
torchrun, on the machines measured.

Examples come from a real run when given (``--workdir`` of a finished run and
``--dataset``: its pool, tokenizer and base model), else they are synthetic: log-normal
lengths (median ``--median``, capped at ``--max-length``) with the first half of each
example a prompt without loss, on a randomly initialised Llama of the ``--size`` given.

    python benchmarks/bench_train_step.py [--size small|large] [--threads 1]
    python benchmarks/bench_train_step.py --workdir /tmp/emb_full --dataset pycode --size large
    python benchmarks/bench_train_step.py --smoke   (tiny model and batches, seconds)

The packed rows (``train.packing``) run each step's examples as one row with attention
inside each example (sdpa over length-grouped blocks on the CPU): no padding at all; their
real tokens per second are printed beside the padded variants', and the packed step's time
over the padded default's (micro-batches + label-only head) is the last ratio. Variants
are interleaved over the repeats (each timed as its best), so machine load hits them alike;
``--cpu-time`` times process CPU seconds instead of wall seconds (for a loaded machine).

The ratios to the plain step are printed last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from clusterft.modeling.microbatch import CausalLMLoss, backward_step  # noqa: E402
from clusterft.modeling.packing import pack_collate  # noqa: E402
from clusterft.modeling.precision import native_bf16  # noqa: E402
from clusterft.modeling.tokenize import IGNORE_INDEX, Collator  # noqa: E402


def synthetic(n: int, median: float, max_length: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), 0.5, n)), 8, max_length).astype(int)
    out = []
    for k in lengths:
        ids = rng.integers(3, vocab, k).tolist()
        labels = [IGNORE_INDEX] * (k // 2) + ids[k // 2:]
        out.append({"input_ids": ids, "labels": labels, "length": int(k)})
    return out


def from_run(workdir: Path, dataset: str, size: str, max_length: int, n: int):
    from clusterft.pipeline.io import read_jsonl
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.tokenize import encode_records
    from transformers import AutoModelForCausalLM

    model_dir = workdir / "results" / "models" / size / "base"
    tok = load_tokenizer(str(model_dir))
    records = read_jsonl(workdir / "results" / "data" / dataset / "pool.jsonl")[:n]
    examples, _ = encode_records(tok, records, max_length, "truncate")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return examples, model


SMOKE_SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2}


def random_model(size: str, vocab: int):
    """A randomly initialised Llama of config/config.yaml's models.<size>.size (``tiny``:
    the smoke size)."""
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())
    torch.manual_seed(0)
    shape = SMOKE_SIZE if size == "tiny" else cfg["models"][size]["size"]
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, max_position_embeddings=512,
                                        pad_token_id=0, **shape))


def step(model, loss_fn, batch_examples, collate, group_cost: float, plain: bool,
         bf16: bool = False, packed: bool = False) -> int:
    """One forward + backward; returns padded tokens processed."""
    if plain:
        batch = collate(batch_examples)
        model(**batch).loss.backward()
        return int(batch["input_ids"].numel())
    return backward_step(loss_fn, batch_examples, pack_collate if packed else collate,
                         group_cost, "cpu", bf16, packed=packed)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=["small", "large"])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--dataset", default="pycode")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--median", type=float, default=90)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--group-cost", type=float, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 2 steps of 4 short examples, 1 repeat (seconds)")
    ap.add_argument("--quick", action="store_true", help="the same as --smoke")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time process CPU seconds, not wall seconds")
    args = ap.parse_args()
    if args.smoke or args.quick:
        args.size, args.workdir, args.batch, args.steps, args.repeats = "tiny", None, 4, 2, 1
        args.median, args.max_length, args.group_cost = 16.0, 48, 16.0
    torch.set_num_threads(args.threads)
    n = args.batch * args.steps
    if args.workdir is not None:
        examples, model = from_run(args.workdir, args.dataset, args.size, args.max_length, n)
        source = f"{args.workdir}/results/data/{args.dataset}/pool.jsonl, base model {args.size}"
    else:
        examples = synthetic(n, args.median, args.max_length, 2048, seed=0)
        model = random_model(args.size, 2048)
        source = f"synthetic log-normal lengths (median {args.median:g}), random {args.size} model"
    model.config.use_cache = False
    model.train()
    collate = Collator(0)
    batches = [examples[i:i + args.batch] for i in range(0, len(examples), args.batch)]
    # name: (plain, group cost, label-only head, bf16, packed)
    variants = {"plain padded batch": (True, -1.0, False, False, False),
                "micro-batches": (False, args.group_cost, False, False, False),
                "label-only head": (False, -1.0, True, False, False),
                "micro-batches + label-only head": (False, args.group_cost, True, False, False),
                "packed + label-only head": (False, 0.0, True, False, True),
                "packed, full head": (False, 0.0, False, False, True)}
    if native_bf16("cpu"):
        variants["micro + label-only + bf16 autocast"] = (False, args.group_cost, True, True, False)
    clock = time.process_time if args.cpu_time else time.perf_counter
    best = {name: float("inf") for name in variants}
    padded = {}

    def run(name, bs):
        plain, cost, sparse, bf16, packed = variants[name]
        loss_fn = CausalLMLoss(model, sparse_logits=sparse, packing=packed)
        try:
            return sum(step(model, loss_fn, b, collate, cost, plain, bf16, packed) for b in bs)
        finally:
            loss_fn.release()

    for _ in range(args.repeats):  # interleaved: load on the machine hits every variant
        for name in variants:
            model.zero_grad(set_to_none=True)
            t = clock()
            padded[name] = run(name, batches)
            best[name] = min(best[name], clock() - t)
    ref_grads = None
    rows = []
    for name in variants:
        model.zero_grad(set_to_none=True)
        run(name, batches[:1])
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if ref_grads is None:
            ref_grads = grads
        diff = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads))
        rows.append((name, best[name] / len(batches), padded[name] / len(batches), diff))
    real = sum(e["length"] for e in examples) / len(batches)
    print(f"{source}; {len(batches)} steps of {args.batch} examples, {real:.0f} real tokens/step, "
          f"{args.threads} thread(s), best of {args.repeats} "
          f"({'CPU' if args.cpu_time else 'wall'} seconds)")
    base = rows[0][1]
    print(f"{'variant':<36}{'s/step':>9}{'ratio':>8}{'real tok/s':>12}{'padded tok/step':>17}"
          f"{'max |dgrad|':>13}")
    for name, s, p, diff in rows:
        print(f"{name:<36}{s:>9.4f}{s / base:>8.2f}{real / s:>12.0f}{p:>17.0f}{diff:>13.2e}")
    by = {name: s for name, s, _, _ in rows}
    default = by["micro-batches + label-only head"]
    print(f"packed vs padded (both label-only head): {default / by['packed + label-only head']:.2f}x "
          "the real tokens per second")
    print("ratios, time per step over the plain padded step's: "
          + ", ".join(f"{name} {s / base:.2f}x" for name, s, _, _ in rows[1:])
          + f"; packed over micro-batches + label-only head "
            f"{by['packed + label-only head'] / default:.2f}x")


if __name__ == "__main__":
    main()
