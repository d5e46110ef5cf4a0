"""The CPU kernel of float32 linear layers, ATen (MKL's sgemm) vs oneDNN, side by side in one
run: why ``cpu_matmul: auto`` takes oneDNN on AMD CPUs (``clusterft.modeling.cpu_matmul``).

Two parts, each kernel switched in turn in this one process (``cpu_matmul.install``) and
interleaved over ``--repeats`` (each timed as its best, so machine load hits both alike):

- **products**: the three products of a linear layer (forward ``x W^T``, backward ``dy W``
  and ``dy^T x``) at config/config.yaml's model shapes (hidden, MLP and vocabulary widths)
  for ``--rows`` rows (755: a packed training step of 8 pycode examples; 2048: a
  pretraining step of 16 blocks of 128), in GFLOP/s;
- **steps**: the stages' own steps on models of config/config.yaml's ``models.<size>.size``:
  base-model pretraining and practice (``bench_threads.time_pretrain`` / ``time_practice``:
  the stage code), a packed training step with the label-only head (forward + backward,
  ``bench_train_step.step``) and a no-grad forward of the same batch (what score's loss
  passes and lm-eval's requests do), at each ``--threads`` count; and the largest
  difference of the training step's gradients between the kernels (float rounding: both
  are float32).

    python benchmarks/bench_matmul.py [--sizes small,large] [--threads 1,2] [--repeats 3]
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_matmul.py   (oneDNN held to AVX2, as on
        an AVX2-only CPU; MKL runs AVX2 on AMD anyway)
    python benchmarks/bench_matmul.py --smoke   (a tiny model, seconds)

It prints the ratio aten / onednn of each row last (above 1: oneDNN faster). The figures
belong to the machine: benchmarks/README.md names it.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "workflow"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

KERNELS = ("aten", "onednn")


def product_shapes(size: dict, vocab: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of a Llama layer's linear products and the head."""
    h, m = int(size["hidden_size"]), int(size["intermediate_size"])
    return [("attention h->h", h, h), ("MLP up h->m", h, m), ("MLP down m->h", m, h),
            ("head h->vocab", h, vocab)]


def time_products(rows: int, d_in: int, d_out: int, reps: int) -> float:
    """Seconds for the forward and both backward products of one linear layer."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(rows, d_in, requires_grad=True)
    g = torch.randn(rows, d_out)
    for _ in range(2):
        layer(x).backward(g)
    t = time.perf_counter()
    for _ in range(reps):
        layer(x).backward(g)
    return (time.perf_counter() - t) / reps


def step_batches(size_name: str, size: dict, n: int, batch: int, smoke: bool):
    """A random Llama of ``size`` and ``n`` synthetic examples in batches of ``batch``."""
    import torch
    from bench_train_step import random_model, synthetic

    examples = synthetic(n, 16.0 if smoke else 90.0, 48 if smoke else 192, 2048, seed=0)
    model = random_model("tiny" if size_name == "tiny" else size_name, 2048)
    model.config.use_cache = False
    torch.manual_seed(0)
    return model, [examples[i:i + batch] for i in range(0, n, batch)]


def time_train(model, batches, threads: int) -> float:
    """Seconds per packed training step (label-only head), forward + backward."""
    import torch
    from bench_train_step import step

    from clusterft.modeling.microbatch import CausalLMLoss
    from clusterft.modeling.tokenize import Collator

    torch.set_num_threads(threads)
    model.train()
    loss_fn = CausalLMLoss(model, sparse_logits=True, packing=True)
    try:
        step(model, loss_fn, batches[0], Collator(0), 0.0, False, packed=True)
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        for b in batches:
            step(model, loss_fn, b, Collator(0), 0.0, False, packed=True)
        return (time.perf_counter() - t) / len(batches)
    finally:
        loss_fn.release()


def time_forward(model, batches, threads: int) -> float:
    """Seconds per no-grad forward of a padded batch (eval mode)."""
    import torch

    from clusterft.modeling.tokenize import Collator

    torch.set_num_threads(threads)
    model.eval()
    collated = [Collator(0)(b) for b in batches]
    with torch.no_grad():
        model(input_ids=collated[0]["input_ids"], attention_mask=collated[0]["attention_mask"])
        t = time.perf_counter()
        for c in collated:
            model(input_ids=c["input_ids"], attention_mask=c["attention_mask"])
    return (time.perf_counter() - t) / len(collated)


def gradient_gap(model, batch) -> float:
    """Largest |gradient difference| of one packed step between the kernels, relative to the
    largest gradient."""
    from bench_train_step import step

    from clusterft.modeling import cpu_matmul
    from clusterft.modeling.microbatch import CausalLMLoss
    from clusterft.modeling.tokenize import Collator

    model.train()
    grads = {}
    for kernel in KERNELS:
        cpu_matmul.install(kernel)
        loss_fn = CausalLMLoss(model, sparse_logits=True, packing=True)
        model.zero_grad(set_to_none=True)
        step(model, loss_fn, batch, Collator(0), 0.0, False, packed=True)
        loss_fn.release()
        grads[kernel] = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    scale = max(float(g.abs().max()) for g in grads["aten"])
    return max(float((a - b).abs().max()) for a, b in zip(*grads.values())) / scale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="small,large",
                    help="names in config/config.yaml's models (their `size`)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="755,2048", help="rows of the products timed")
    ap.add_argument("--steps", type=int, default=20, help="pretraining steps timed per run")
    ap.add_argument("--practice-steps", type=int, default=30)
    ap.add_argument("--train-steps", type=int, default=6, help="training steps of 8 examples")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, few steps")
    args = ap.parse_args(argv)

    import logging
    import tempfile

    import torch

    from bench_threads import TINY, config_sizes, corpus, time_pretrain, time_practice
    from clusterft.modeling import cpu_matmul
    from clusterft.pipeline import hardware
    from clusterft.stages.models import train_tokenizer

    logging.basicConfig(level=logging.WARNING)
    if not cpu_matmul.onednn_available():
        print("this torch build has no oneDNN linear: nothing to compare")
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if args.smoke:
        sizes, steps, psteps, tsteps, repeats, rows = {"tiny": TINY}, 2, 2, 2, 1, [64]
    else:
        known = config_sizes()
        sizes = {s: known[s] for s in args.sizes.split(",")}
        steps, psteps, tsteps, repeats = (args.steps, args.practice_steps, args.train_steps,
                                          args.repeats)
    docs = corpus(400)
    with tempfile.TemporaryDirectory(prefix="bench-matmul-") as tmp:
        tok = train_tokenizer(docs, 2048, Path(tmp) / "tok")
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    print(f"torch {torch.__version__}; {hardware.cpu_model()} ({hardware.cpu_vendor()}), "
          f"{os.cpu_count()} CPUs; auto -> {cpu_matmul.choose('auto')}"
          f"{'; ONEDNN_MAX_CPU_ISA=' + isa if isa else ''}; best of {repeats}", flush=True)
    best: dict = {}

    def timed(key, kernel, fn):
        cpu_matmul.install(kernel)
        best[key + (kernel,)] = min(best.get(key + (kernel,), np.inf), fn())

    models = {name: step_batches(name, size, 8 * tsteps, 8, args.smoke)
              for name, size in sizes.items()}
    for _ in range(repeats):
        for kernel in KERNELS:
            torch.set_num_threads(1)
            for name, size in sizes.items():
                for label, d_in, d_out in product_shapes(size, 2048):
                    for r in rows:
                        timed(("product", name, f"{label}, {r} rows", 1), kernel,
                              lambda: time_products(r, d_in, d_out, 3 if args.smoke else 20))
            for name, size in sizes.items():
                model, batches = models[name]
                for t in threads:
                    timed(("step", name, "pretrain", t), kernel,
                          lambda: time_pretrain(tok, size, docs, steps, t))
                    timed(("step", name, "practice", t), kernel,
                          lambda: time_practice(tok, size, psteps, t))
                    timed(("step", name, "train (packed)", t), kernel,
                          lambda: time_train(model, batches, t))
                    timed(("step", name, "forward", t), kernel,
                          lambda: time_forward(model, batches, t))
    torch.set_num_threads(1)
    gaps = {name: gradient_gap(model, batches[0]) for name, (model, batches) in models.items()}
    cpu_matmul.uninstall()
    keys = sorted({k[:-1] for k in best}, key=lambda k: (k[0] != "product", k[1], k[2], k[3]))
    print(f"{'part':8s} {'model':6s} {'what':32s} {'thr':>3s} {'aten':>10s} {'onednn':>10s}"
          f" {'ratio':>6s}")
    ratios = []
    for key in keys:
        a, o = best[key + ("aten",)], best[key + ("onednn",)]
        unit = "s"
        if key[0] == "product":
            label = key[2].split(",")[0]
            d_in, d_out = next((i, j) for n, i, j in product_shapes(sizes[key[1]], 2048)
                               if n == label)
            r = int(key[2].split(", ")[1].split()[0])
            a, o, unit = 6 * r * d_in * d_out / a / 1e9, 6 * r * d_in * d_out / o / 1e9, "GF/s"
            ratio = o / a
        else:
            ratio = a / o
        ratios.append(f"{key[1]} {key[2]} x{key[3]} {ratio:.2f}x")
        print(f"{key[0]:8s} {key[1]:6s} {key[2]:32s} {key[3]:>3d} {a:>9.4g}{unit[0]} "
              f"{o:>9.4g}{unit[0]} {ratio:>5.2f}x" + ("  (GFLOP/s)" if unit == "GF/s" else ""))
    for name, gap in gaps.items():
        print(f"{name}: training step's gradients, max |aten - onednn| / max |g| = {gap:.1e}")
    print("ratios (oneDNN's speed over ATen's; above 1: oneDNN faster): " + "; ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
