"""Benchmark the projection of per-example LoRA gradients: dense (LESS) vs Kronecker (LoGra).

Part 1, same model, batch, projection dim and torch threads for all three (a randomly
initialised Llama with peft LoRA on q/k/v/o, lora_B nonzero as after a warm-up; the batch
of ``benchmarks/bench_score.py``):

(a) **LESS loop**: one example at a time: forward, backward, flatten the LoRA gradient,
    dense projection (``clusterft.stages.score.Projector``, as ``score.projection: rademacher``);
(b) **hook + dense**: the batched hook path, ``dW = einsum(dy, x)`` per layer, flatten,
    the same dense projection (the score stage's default);
(c) **hook + kronecker**: the batched hook path, ``x`` and ``dy`` projected first, blocks
    ``P_out^T dW P_in`` (``score.projection: kronecker``).

Examples per second (best of ``--repeats``) and the peak memory of one call.

Part 2, the projection step alone on synthetic layers of 7B shapes (hidden 4096): LoRA
matrices [r, 4096] and [4096, r] (r = ``--rank``), and full weights [4096, 4096], for
gradient sizes D from 1e6 to 1e8 (LoRA: D / (r * 4096) matrices; full: 1, 2 and 6 weights).
Inputs ``x``, ``dy`` of ``--scan-batch`` examples of ``--tokens`` tokens are given (one
call projects them all, as one batch of the score stage; times are per example, memory
per call). Dense: the per-layer ``dW`` formed and flattened, then the [D, dim] matrix
generated chunk by chunk as the score stage does once it is over 1 GB (once per batch),
the time of the first ``--dense-chunks`` chunks extrapolated to all of D; kronecker: all
layers' blocks; its factor matrices (made once per run) are reported apart. Kronecker's
peak stays flat as D grows; dense's grows with D (the flattened gradients), its time with
D * dim.

Memory: the peak resident set size (RSS) increase over the RSS just before the call: the
Linux high-water mark ``VmHWM`` of /proc/self/status, reset by writing 5 to
/proc/self/clear_refs before the call. The script re-executes itself with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every freed tensor to the system
(otherwise memory freed by one call is reused unseen by the next). Elsewhere it falls back
to ``resource.getrusage`` (not resettable: an upper bound, said in the header).

The table ends with the ratios: kronecker vs LESS loop examples/s, and dense / kronecker
time and memory (hook path, and the projection step at the largest D).

    python benchmarks/bench_projection.py [--smoke] [--threads 1] [--repeats 3] [--dim 1024]

``--smoke`` (tiny sizes, a few seconds) checks that the script runs; its figures mean
little.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

if (sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ
        and __name__ == "__main__"):
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    os.execv(sys.executable, [sys.executable, *sys.argv])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HIDDEN_7B = 4096


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _can_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return _status_kb("VmHWM") is not None
    except OSError:
        return False


RESETTABLE = _can_reset()
MEMORY_HOW = ("peak RSS increase over the call (VmHWM reset via /proc/self/clear_refs)"
              if RESETTABLE else "peak RSS of the process so far (ru_maxrss, not resettable: "
              "an upper bound)")


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.mb``: the peak RSS increase during the block."""

    def __enter__(self) -> "PeakRSS":
        if RESETTABLE:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self.base = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if RESETTABLE:
            self.mb = max(0, _status_kb("VmHWM") - self.base) / 1024
        else:
            import resource

            self.mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def measure(fn, repeats: int):
    """(best seconds, peak MB of one call, output)."""
    with PeakRSS() as m:
        fn()
    sec, out = best_time(fn, repeats)
    return sec, m.mb, out


# --------------------------------------------------------------------------- part 1

def bench_paths(args) -> dict:
    from bench_score import random_batch, tiny_lora_llama

    from clusterft.stages.score import grads_loop, make_projector, merge_cfg, project_batch

    model = tiny_lora_llama(hidden=args.hidden, inter=2 * args.hidden, layers=args.layers,
                            heads=args.heads, vocab=args.vocab, r=args.rank)
    batch = random_batch(n=args.batch, max_len=args.max_len, prompt=args.max_len // 4,
                         vocab=args.vocab)
    dense_cfg = merge_cfg({"dim": args.dim, "projection": "rademacher"})
    kron_cfg = merge_cfg({"dim": args.dim, "projection": "kronecker"})
    dense, kron = make_projector(model, dense_cfg, 0), make_projector(model, kron_cfg, 0)
    d = dense.d
    n = batch["input_ids"].shape[0]

    def less_loop():
        rows = []
        for b in range(n):
            one = {k: v[b:b + 1] for k, v in batch.items()}
            rows.append(dense(grads_loop(model, one)))
        return torch.cat(rows)

    fns = {"(a) LESS loop, dense": less_loop,
           "(b) hook + dense": lambda: project_batch(model, batch, dense_cfg, dense)[0],
           "(c) hook + kronecker": lambda: project_batch(model, batch, kron_cfg, kron)[0]}
    for fn in fns.values():  # first-call costs (and the dense matrix's cache) out of the timings
        fn()
    n_params = sum(p.numel() for p in model.parameters())
    cached = "cached" if dense.cache else "regenerated at every call"
    print(f"part 1: Llama {n_params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} "
          f"layers), LoRA r={args.rank} D={d}, batch {tuple(batch['input_ids'].shape)}, dim "
          f"{args.dim} (dense matrix {d * args.dim * 4 / 2**20:.0f} MB, {cached}; kronecker "
          f"blocks {kron.blocks()[0][:2]} per matrix), torch threads {torch.get_num_threads()}, "
          f"best of {args.repeats}")
    print(f"memory: {MEMORY_HOW}")
    rows = {}
    for label, fn in fns.items():
        rows[label] = measure(fn, args.repeats)
    cos = torch.nn.functional.cosine_similarity(rows["(a) LESS loop, dense"][2],
                                                rows["(b) hook + dense"][2], dim=1).min()
    print(f"{'path':<24}{'s/batch':>10}{'ex/s':>10}{'peak MB':>10}")
    for label, (sec, mb, _) in rows.items():
        print(f"{label:<24}{sec:>10.3f}{n / sec:>10.1f}{mb:>10.1f}")
    print(f"(a) and (b) agree: min cosine {float(cos):.6f}")
    return {k: (n / sec, mb) for k, (sec, mb, _) in rows.items()}


# --------------------------------------------------------------------------- part 2

def scan_shapes(kind: str, d_target: float, rank: int) -> list[tuple[int, int]]:
    if kind == "lora":
        pairs = max(1, round(d_target / (2 * rank * HIDDEN_7B)))
        return [(rank, HIDDEN_7B), (HIDDEN_7B, rank)] * pairs
    return [(HIDDEN_7B, HIDDEN_7B)] * max(1, round(d_target / HIDDEN_7B ** 2))


def bench_scan(args) -> dict:
    from clusterft.stages.score.projection import KroneckerProjector
    from clusterft.stages.score import PROJECTION_CHUNK_ROWS, Projector

    t, b = args.tokens, args.scan_batch
    gen = torch.Generator().manual_seed(0)
    acts = {d: torch.randn(b, t, d, generator=gen) for d in {HIDDEN_7B, args.rank}}
    grads = {d: torch.randn(b, t, d, generator=gen) for d in {HIDDEN_7B, args.rank}}
    print(f"\npart 2: the projection step alone, {b} examples of {t} tokens per call, 7B shapes "
          f"(hidden {HIDDEN_7B}), dim {args.scan_dim}; dense time extrapolated from its first "
          f"{args.dense_chunks} chunks of {PROJECTION_CHUNK_ROWS} rows; memory: {MEMORY_HOW}")
    print(f"{'shapes':<14}{'D':>10}{'layers':>8}{'dense s/ex':>12}{'dense MB':>10}"
          f"{'kron s/ex':>12}{'kron MB':>10}{'factors MB':>12}{'kron block':>12}"
          "  (MB: peak per call)")
    out = {}
    for kind, targets in (("lora", args.lora_d), ("full", args.full_d)):
        for d_target in targets:
            shapes = scan_shapes(kind, d_target, args.rank)
            d = sum(a * b for a, b in shapes)
            label = f"{kind} r={args.rank}" if kind == "lora" else "full 4096^2"

            def form():  # what the hook path does before a dense projection
                return torch.cat([torch.einsum("bto,bti->boi", grads[o], acts[i]).reshape(b, -1)
                                  for o, i in shapes], dim=1)

            dense = Projector(d, args.scan_dim, 0, "rademacher", cache_bytes=0)
            chunks = min(dense.n_chunks, args.dense_chunks)
            with PeakRSS() as dm:
                t0 = time.perf_counter()
                g = form()
                t_form = time.perf_counter() - t0
                t0 = time.perf_counter()
                acc = None
                for c in range(chunks):
                    lo = c * PROJECTION_CHUNK_ROWS
                    part = g[:, lo:lo + PROJECTION_CHUNK_ROWS] @ dense.chunk(c)
                    acc = part if acc is None else acc + part
                t_proj = (time.perf_counter() - t0) * dense.n_chunks / chunks
                del g, acc
            dense_s = (t_form + t_proj) / b
            kron = KroneckerProjector(shapes, args.scan_dim, 0)
            factors_mb = sum(p.numel() * 4 for p in kron.p_in + kron.p_out
                             if p is not None) / 2**20

            def kron_step():
                return kron.finish([kron.project_layer(i, acts[di], grads[do])
                                    for i, (do, di) in enumerate(shapes)])

            kron_step()
            kron_s, kron_mb, _ = measure(kron_step, args.repeats)
            kron_s /= b
            block = "x".join(map(str, kron.blocks()[0][:2]))
            print(f"{label:<14}{d:>10.2e}{len(shapes):>8}{dense_s:>12.4f}{dm.mb:>10.1f}"
                  f"{kron_s:>12.5f}{kron_mb:>10.1f}{factors_mb:>12.1f}{block:>12}")
            out[(kind, d)] = (dense_s, dm.mb, kron_s, kron_mb)
            del kron
    return out


def _ratio(a: float, b: float, floor: float = 0.1) -> str:
    """a / b; a denominator under ``floor`` (MB: below what RSS resolves) reads as >=."""
    return f"{a / b:.1f}x" if b >= floor else f">={a / floor:.0f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, a few seconds: checks that the script runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=1024,
                    help="projection dim of part 1 (1024: the dense matrix, 512 MB, stays cached)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=8, help="LoRA r (parts 1 and 2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--scan-dim", type=int, default=8192, help="projection dim of part 2")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per example in part 2")
    ap.add_argument("--scan-batch", type=int, default=4,
                    help="examples per call in part 2 (dense at D=1e8: 2 x 1.6 GB)")
    ap.add_argument("--dense-chunks", type=int, default=8,
                    help="dense chunks timed in part 2 (the rest extrapolated)")
    ap.add_argument("--lora-d", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    ap.add_argument("--full-d", type=float, nargs="+", default=[1.7e7, 3.4e7, 1e8])
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.dim, args.hidden, args.layers, args.heads = 1, 256, 64, 2, 4
        args.vocab, args.batch, args.max_len = 512, 4, 32
        args.scan_dim, args.tokens, args.dense_chunks, args.scan_batch = 256, 16, 1, 2
        args.lora_d, args.full_d = [1e5, 1e6], [1.7e7]
    if args.threads:
        torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    paths = bench_paths(args)
    scan = bench_scan(args)
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    (a_ex, _), (b_ex, b_mb), (c_ex, c_mb) = paths.values()
    print("ratios")
    print(f"  kronecker (c) vs LESS loop (a), examples/s: {c_ex / a_ex:.2f}x")
    print(f"  dense (b) / kronecker (c), hook path: time {c_ex / b_ex:.2f}x, "
          f"peak memory {_ratio(b_mb, c_mb)}")
    for kind in ("lora", "full"):
        d = max(k[1] for k in scan if k[0] == kind)
        dense_s, dense_mb, kron_s, kron_mb = scan[(kind, d)]
        print(f"  dense / kronecker, projection step, {kind} shapes at D={d:.2e}: time "
              f"{dense_s / kron_s:.0f}x, peak memory {_ratio(dense_mb, kron_mb)}")


if __name__ == "__main__":
    main()
