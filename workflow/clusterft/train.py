"""Data-parallel fine-tuning (DDP) of a base model on a selected subset of the pool.

Run one process per rank with torchrun::

    torchrun --standalone --nproc-per-node N -m clusterft.train --model DIR --pool POOL \
        --selection SEL.parquet --out OUT_DIR --metrics OUT.json \
        --distribution random|balanced --seed S --config CFG

or call :func:`run_train` in a single process (world size 1, no process group). The
global batch is ``global_batch_size`` when set (each rank takes its share, so every rank
count trains the same optimiser steps and only the split of the work differs), else the
per-rank ``batch_size`` times the world size (more ranks take fewer, larger steps).
``distribution: random`` shards with ``DistributedSampler(shuffle=True)``; ``balanced``
with ``ClusterBalancedSampler`` (clusters from the selection, lengths = token counts).
Rank 0 saves the model dir (LoRA merged into the weights) and ``train_metrics.json``.
Each rank's step batch runs as length-sorted micro-batches with the LM head applied only
at labelled positions (``clusterft.microbatch``): the gradient of the padded batch, with
less padding and head work (``group_cost_tokens``, ``sparse_logits``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import hardware
from .config import merge_section
from .errors import InputError
from .io import atomic_path, read_jsonl, set_offline_env, write_json
from .microbatch import CausalLMLoss, backward_step, label_count
from .models import PRECISIONS, lr_lambda, resolve_precision
from .runtime import freeze_for_exit
from .tokenize import POLICIES, Collator, check_messages, encode_records

DISTRIBUTIONS = ("random", "balanced")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")

DEFAULTS: dict = {
    # full: train every weight; lora: train LoRA adapters (merged into the weights on save).
    "finetune": "full",
    # Peak AdamW learning rate.
    "lr": 1.0e-3,
    # AdamW weight decay.
    "weight_decay": 0.0,
    # Fraction of the total optimiser steps spent on linear warm-up.
    "warmup_ratio": 0.05,
    # Decay after warm-up: linear | cosine | constant (decays to 10% of lr).
    "schedule": "linear",
    # Passes over the selected data.
    "epochs": 3,
    # Examples per rank per step (global batch = batch_size * world_size); ignored when
    # global_batch_size is set.
    "batch_size": 8,
    # Examples per optimiser step over all ranks; each rank takes global_batch_size /
    # world_size (it must divide), so every GPU count trains the same steps on the same
    # global batches. null: batch_size per rank.
    "global_batch_size": None,
    # Longest example in tokens (prompt + response + BOS/EOS).
    "max_length": 256,
    # Longer examples: truncate (cut the response end; see clusterft.tokenize; counted in
    # train_metrics truncated_examples) | reject (drop; counted in rejected_examples) | error
    # (stop, naming the pool file, line and record id). score checks the whole pool against
    # this first, so error (or a pool that reject would empty) stops before gradient work.
    "truncation": "truncate",
    # Length-grouped micro-batches: each rank's step batch is sorted by length and cut into
    # groups padded separately (same gradient, less padding; clusterft.microbatch). The cut
    # minimises padded tokens + this cost per extra group; -1 = one padded batch per step.
    # A GPU, where a small group wastes the device, wants a larger cost than a CPU.
    "group_cost_tokens": 256,
    # Pad each micro-batch to a multiple of this many tokens (1 = to its longest). Fewer
    # distinct shapes: oneDNN's bf16 kernels on CPU are built per shape, and GPUs like
    # multiples of 8.
    "pad_to_multiple_of": 1,
    # auto | bf16 | fp32: bf16 autocasts matmuls to bfloat16 (weights, optimiser and loss stay
    # float32); auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU (CPUs without native
    # bf16 emulate it, much slower: clusterft.models.resolve_precision).
    # train_metrics.json records the precision.
    "precision": "auto",
    # Apply the LM head only where a next token has a label (the response), for
    # architectures where that is exact (llama, mistral, qwen2, qwen3); false = full logits.
    "sparse_logits": True,
    # Gradient-norm clip (0 disables).
    "grad_clip": 1.0,
    # LoRA settings (used when finetune: lora).
    "lora": {
        # Adapter rank.
        "r": 8,
        # Scaling numerator (scale = alpha / r).
        "alpha": 16,
        # Dropout on the adapter input.
        "dropout": 0.05,
        # Linear layers that get adapters.
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    },
    # Drop the last incomplete global batch of each epoch (DistributedSampler pads otherwise).
    "drop_last": False,
    # Torch intra-op threads per rank (0 = available cores / ranks on this node, at least 1;
    # outside torchrun an explicit OMP_NUM_THREADS wins).
    "num_threads": 0,
    # Record the loss curve every this many steps.
    "log_every": 5,
    # Save a resumable checkpoint under OUT_DIR + '.ckpt/' every this many steps (0 = never);
    # a run that finds a matching checkpoint resumes from it. Deleted when training completes.
    "checkpoint_every": 0,
    # Stop after this many optimiser steps in total (0 = no limit; the schedule still spans
    # all epochs). For smoke tests and for testing resume.
    "max_steps": 0,
    # Process-group backend: auto (nccl with CUDA, else gloo) | gloo | nccl.
    "backend": "auto",
    # auto (cuda if available) | cpu | cuda.
    "device": "auto",
}


# --------------------------------------------------------------------------- config / dist

def train_config(cfg: dict | None) -> dict:
    """Merge ``cfg`` over DEFAULTS; unknown keys and bad values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "train")
    if out["finetune"] not in ("full", "lora"):
        raise InputError(f"finetune must be full or lora, got '{out['finetune']}'", field="train.finetune")
    for k in ("epochs", "batch_size", "max_length", "pad_to_multiple_of"):
        if int(out[k]) < 1:
            raise InputError(f"{k} must be >= 1, got {out[k]}", field=f"train.{k}")
    gbs = out["global_batch_size"]
    if gbs is not None and (isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1):
        raise InputError(f"global_batch_size must be a positive integer or null, got {gbs!r}",
                         field="train.global_batch_size")
    if out["precision"] not in PRECISIONS:
        raise InputError(f"precision must be one of {'|'.join(PRECISIONS)}, got "
                         f"'{out['precision']}'", field="train.precision")
    if out["truncation"] not in POLICIES:
        raise InputError(f"truncation must be one of {'|'.join(POLICIES)}, got "
                         f"'{out['truncation']}'", field="train.truncation")
    for key, valid in (("backend", BACKENDS), ("device", DEVICES)):
        if out[key] not in valid:
            raise InputError(f"{key} must be one of {'|'.join(valid)}, got '{out[key]}'",
                             field=f"train.{key}")
    return out


def rank_batch_size(cfg: dict, world_size: int) -> int:
    """Examples per rank per step: ``global_batch_size / world_size`` when set (it must
    divide evenly), else ``batch_size``."""
    gbs = cfg.get("global_batch_size")
    if gbs is None:
        return int(cfg["batch_size"])
    if int(gbs) % int(world_size):
        raise InputError(f"global_batch_size {gbs} does not split evenly over {world_size} ranks; "
                         "use a multiple of every GPU count in the sweep",
                         field="train.global_batch_size")
    return int(gbs) // int(world_size)


def die_with_launcher() -> None:
    """Under torchrun, let this rank die with its launcher (Linux PR_SET_PDEATHSIG).

    torchrun starts every rank in a session of its own, so a job killed with SIGKILL (its
    process group, e.g. a killed Snakemake run) would leave the ranks training, and rank 0
    writing the outputs, behind the back of the rerun that resumes from the checkpoint.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def parse_config_arg(value: str | None) -> dict:
    """``--config``: a YAML/JSON file path or an inline JSON/YAML mapping.

    A mapping with a ``train`` section (a whole project config) yields that section.
    """
    import yaml

    if not value:
        return {}
    if os.path.exists(value):
        try:
            cfg = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise InputError(f"malformed YAML/JSON: {e}", path=value) from e
    else:
        try:
            cfg = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise InputError(f"--config is neither a file nor valid JSON/YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise InputError("--config must be a mapping (or a file holding one)")
    if isinstance(cfg.get("train"), dict):
        cfg = cfg["train"]
    return cfg


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    initialized: bool = False


def resolve_backend(backend: str, cuda: bool) -> str:
    """The process-group backend for `train.backend` on CUDA or CPU ranks: auto picks nccl
    with CUDA, else gloo; nccl on CPU ranks is an error (naming the key) before any work."""
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise InputError("backend: nccl needs CUDA ranks, but this run trains on the CPU; use "
                         "gloo or auto (or device: cuda on a GPU machine)", field="train.backend")
    return backend


def setup_distributed(cfg: dict) -> Dist:
    """Init the process group when launched by torchrun with more than one rank, else world 1.

    One rank trains without a process group or DDP wrapper, even under torchrun: the same
    model (DDP over one rank averages nothing), without the all-reduces of the gradients and
    of the label count at every step (tests/test_train.py checks the weights are equal)."""
    import torch.distributed as dist

    want_cuda = cfg["device"] == "cuda" or (cfg["device"] == "auto" and torch.cuda.is_available())
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise InputError("device: cuda but no CUDA device is available", field="train.device")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device = torch.device(f"cuda:{local_rank}") if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    initialized = False
    if world > 1:
        backend = resolve_backend(cfg["backend"], want_cuda)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        initialized = True
        world, rank = dist.get_world_size(), dist.get_rank()
    return Dist(rank, world, local_rank, local_world, device, initialized)


def _backend(d: Dist) -> str | None:
    """The process group's backend (gloo, nccl), or None for one rank without a group."""
    if not d.initialized:
        return None
    import torch.distributed as dist

    return str(dist.get_backend())


def set_threads(cfg: dict, d: Dist, job_threads: int | None = None) -> int:
    """Set torch intra-op threads per rank: cfg ``num_threads`` if set; else the job's CPU
    threads on this node (``job_threads``, e.g. Snakemake's ``{threads}``) shared by its
    ranks; else (under torchrun, which forces OMP_NUM_THREADS=1) available cores / ranks on
    this node; else OMP_NUM_THREADS if set; else all available cores. At least 1."""
    n = int(cfg["num_threads"])
    if n <= 0 and job_threads:
        n = max(1, int(job_threads) // max(1, d.local_world_size))
    if n <= 0 and "TORCHELASTIC_RUN_ID" not in os.environ and os.environ.get("OMP_NUM_THREADS"):
        n = max(1, int(os.environ["OMP_NUM_THREADS"]))
    if n <= 0:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            cores = os.cpu_count() or 1
        n = max(1, cores // max(1, d.local_world_size))
    torch.set_num_threads(n)
    return n


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- data

def read_selection(path: str | os.PathLike):
    """Read selection.parquet (columns id, cluster, score)."""
    import pandas as pd

    p = Path(path)
    if not p.exists():
        raise InputError("selection file does not exist", path=str(p))
    try:
        df = pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises many types
        raise InputError(f"cannot read parquet: {e}", path=str(p)) from e
    for col in ("id", "cluster"):
        if col not in df.columns:
            raise InputError(f"missing column '{col}' (need id, cluster, score)", path=str(p), field=col)
    if df["id"].duplicated().any():
        dup = df["id"][df["id"].duplicated()].iloc[0]
        raise InputError(f"duplicate id '{dup}'", path=str(p), field="id")
    if len(df) == 0:
        raise InputError("selection is empty", path=str(p))
    return df


def select_records(pool: list[dict], selection, pool_path: str = "pool",
                   selection_path: str = "selection") -> tuple[list[dict], np.ndarray]:
    """Restrict the pool to the selection ids (pool order); returns (records, cluster ids)."""
    by_id: dict[str, int] = {}
    for i, rec in enumerate(pool):
        rid = rec.get("id")
        if not isinstance(rid, str):
            raise InputError("missing or non-string id", path=pool_path, line=i + 1, field="id")
        check_messages(rec.get("messages"), where=pool_path, line=i + 1)
        by_id[rid] = i
    cluster_of = dict(zip(selection["id"].astype(str), selection["cluster"].astype(int)))
    for row, sid in enumerate(selection["id"].astype(str)):
        if sid not in by_id:
            raise InputError(f"id '{sid}' (row {row}) is not in the pool {pool_path}",
                             path=selection_path, field="id")
    idx = sorted(by_id[s] for s in cluster_of)
    records = [pool[i] for i in idx]
    clusters = np.asarray([cluster_of[r["id"]] for r in records], dtype=np.int64)
    return records, clusters


def make_sampler(distribution: str, clusters: np.ndarray, lengths: np.ndarray, d: Dist,
                 batch_size: int, seed: int, drop_last: bool):
    """The per-rank sampler for ``distribution`` (random | balanced)."""
    if distribution == "random":
        from torch.utils.data.distributed import DistributedSampler

        return DistributedSampler(range(len(lengths)), num_replicas=d.world_size, rank=d.rank,
                                  shuffle=True, seed=seed, drop_last=drop_last)
    if distribution == "balanced":
        from .sampler import ClusterBalancedSampler

        return ClusterBalancedSampler(clusters, lengths, num_replicas=d.world_size, rank=d.rank,
                                      batch_size=batch_size, seed=seed, drop_last=drop_last)
    raise InputError(f"unknown distribution '{distribution}' ({'|'.join(DISTRIBUTIONS)})",
                     field="distribution")


def epoch_batches(sampler, epoch: int, batch_size: int) -> list[list[int]]:
    """This rank's batches of one epoch, in step order (no DataLoader: nothing touches RNG)."""
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]


# --------------------------------------------------------------------------- model

def load_model(model_dir: str, cfg: dict):
    """Load the base model (float32) and wrap it with LoRA adapters if finetune: lora."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    if cfg["finetune"] == "lora":
        from peft import LoraConfig, get_peft_model

        lc = cfg["lora"]
        model = get_peft_model(model, LoraConfig(
            r=int(lc["r"]), lora_alpha=float(lc["alpha"]), lora_dropout=float(lc["dropout"]),
            target_modules=list(lc["target_modules"]), bias="none", task_type="CAUSAL_LM"))
    return model


def plain_model(model):
    """The plain HF model to save: LoRA merged into the weights, DDP unwrapped."""
    m = model.module if hasattr(model, "module") and not hasattr(model, "peft_config") else model
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    m.config.use_cache = True
    return m


def save_model_dir(model, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save model + tokenizer atomically as a plain HF dir."""
    m = plain_model(model)
    with atomic_path(out_dir, is_dir=True) as tmp:
        m.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


# --------------------------------------------------------------------------- checkpoints

def _fingerprint(cfg: dict, d: Dist, distribution: str, seed: int, ids: list[str]) -> str:
    keep = {k: v for k, v in cfg.items()
            if k not in ("checkpoint_every", "max_steps", "num_threads", "log_every")}
    blob = json.dumps({"cfg": keep, "world": d.world_size, "dist": distribution, "seed": seed,
                       "ids": hashlib.sha1("\n".join(ids).encode()).hexdigest()},
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(ckpt_dir: Path, inner, opt, sched, state: dict, d: Dist) -> None:
    """Save model/optimizer/scheduler/progress/metrics + every rank's RNG (rank 0 writes)."""
    import torch.distributed as dist

    rngs = [None] * d.world_size
    if d.initialized:
        dist.all_gather_object(rngs, _rng_state())
    else:
        rngs = [_rng_state()]
    if d.rank == 0:
        blob = {"model": inner.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": rngs, **state}
        # One file replaced atomically (not the folder: replacing a folder removes the old
        # one first, and a kill in between would leave no checkpoint at all).
        with atomic_path(Path(ckpt_dir) / "state.pt") as tmp:
            torch.save(blob, tmp)
    if d.initialized:
        dist.barrier()


def load_checkpoint(ckpt_dir: Path, fingerprint: str, d: Dist) -> dict | None:
    """Load a checkpoint that matches this run's fingerprint; warn and ignore one that doesn't."""
    f = ckpt_dir / "state.pt"
    if not f.exists():
        return None
    blob = torch.load(f, map_location="cpu", weights_only=False)
    if blob.get("fingerprint") != fingerprint:
        if d.rank == 0:
            warnings.warn(f"{ckpt_dir}: checkpoint is from a different run (config, ranks, seed "
                          "or data differ); starting from scratch", stacklevel=2)
        return None
    return blob


# --------------------------------------------------------------------------- training

def train_loop(model, tokenizer, examples: list[dict], clusters: np.ndarray, cfg: dict, d: Dist,
               distribution: str, seed: int, ckpt_dir: Path | None = None) -> dict:
    """Fine-tune ``model`` in place on ``examples``; returns the metrics (same on every rank)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .pace import Pace

    bs = rank_batch_size(cfg, d.world_size)
    lengths = np.asarray([e["length"] for e in examples], dtype=np.int64)
    sampler = make_sampler(distribution, clusters, lengths, d, bs, seed, bool(cfg["drop_last"]))
    steps_per_epoch = math.ceil(len(sampler) / bs)
    if d.initialized:  # every rank must take the same number of steps or DDP hangs
        counts = [None] * d.world_size
        dist.all_gather_object(counts, steps_per_epoch)
        if len(set(counts)) != 1:
            raise RuntimeError(f"ranks disagree on steps per epoch: {counts} (sampler bug)")
    epochs = int(cfg["epochs"])
    total_steps = steps_per_epoch * epochs
    if total_steps == 0:
        raise InputError("no training steps (selection smaller than one batch with drop_last)",
                         field="train.drop_last")
    inner = model.to(d.device)
    params = [p for p in inner.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(cfg["lr"]), weight_decay=float(cfg["weight_decay"]))
    warmup = int(round(float(cfg["warmup_ratio"]) * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["schedule"], warmup, total_steps))
    ids = [str(e.get("id")) for e in examples]
    fp = _fingerprint(cfg, d, distribution, seed, ids)
    acc: dict[str, Any] = {"per_rank_tokens_per_step": [], "padded_tokens_per_step": [],
                           "per_rank_loss_tokens_per_step": [], "losses": [], "step_times": [],
                           "wall_time_s": 0.0}
    start_epoch, start_batch, step = 0, 0, 0
    resumed_from = None
    blob = load_checkpoint(ckpt_dir, fp, d) if ckpt_dir is not None else None
    if blob is not None:
        inner.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])
        sched.load_state_dict(blob["scheduler"])
        start_epoch, start_batch, step = blob["epoch"], blob["batch"], blob["step"]
        acc = blob["acc"]
        _set_rng_state(blob["rng"][d.rank])
        resumed_from = step
    loss_fn = CausalLMLoss(inner, sparse_logits=bool(cfg["sparse_logits"]))
    ddp = DDP(loss_fn, device_ids=[d.device.index] if d.device.type == "cuda" else None) \
        if d.initialized else loss_fn
    pad_multiple = int(cfg["pad_to_multiple_of"])
    collate = Collator(tokenizer.pad_token_id, pad_multiple)
    group_cost = float(cfg["group_cost_tokens"])
    precision = resolve_precision(cfg["precision"], d.device, field="train.precision")
    bf16 = precision == "bf16"
    ckpt_every, max_steps = int(cfg["checkpoint_every"]), int(cfg["max_steps"])
    clip = float(cfg["grad_clip"])
    stopped_early = False
    ddp.train()
    # The loop stops at max_steps when that is set: the pace line's finish must too. (Not a
    # `with` block: a failed step ends the process, and the loop stays flat.)
    pace = Pace(min(total_steps, max_steps) if max_steps else total_steps,
                f"train x{d.world_size} ({precision})", initial=step,
                disable=d.rank != 0, mininterval=1.0)
    t_loop = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        batches = epoch_batches(sampler, epoch, bs)
        for b in range(start_batch if epoch == start_epoch else 0, len(batches)):
            t_step = time.perf_counter()
            step_examples = [examples[i] for i in batches[b]]
            labels_here = sum(label_count(e) for e in step_examples)
            denom = float(labels_here)
            if d.initialized:
                # Mean over the global batch's label tokens: DDP averages the ranks'
                # gradients, so each rank divides by (global label count / world size).
                # The step's gradient then does not depend on how the batch is split.
                n = torch.tensor([labels_here], dtype=torch.float64, device=d.device)
                dist.all_reduce(n)
                denom = float(n.item()) / d.world_size
            loss_val, real, padded = backward_step(
                ddp, step_examples, collate, group_cost, d.device, bf16,
                no_sync=ddp.no_sync if d.initialized else None, denom=denom,
                pad_to_multiple_of=pad_multiple)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            stats = torch.tensor([real, padded, labels_here, loss_val],
                                 dtype=torch.float64, device=d.device)
            if d.initialized:
                gathered = [torch.zeros_like(stats) for _ in range(d.world_size)]
                dist.all_gather(gathered, stats)
                rows = torch.stack(gathered).cpu().tolist()
            else:
                rows = [stats.cpu().tolist()]
            acc["per_rank_tokens_per_step"].append([int(r[0]) for r in rows])
            acc["padded_tokens_per_step"].append([int(r[1]) for r in rows])
            acc["per_rank_loss_tokens_per_step"].append([int(r[2]) for r in rows])
            acc["losses"].append(float(np.mean([r[3] for r in rows])))
            acc["step_times"].append(time.perf_counter() - t_step)
            step += 1
            pace.update()
            if step % max(1, int(cfg["log_every"])) == 0:
                pace.set_postfix(loss=f"{acc['losses'][-1]:.3f}")
            done = step == total_steps or (max_steps and step >= max_steps)
            if ckpt_dir is not None and ckpt_every > 0 and step % ckpt_every == 0 and step < total_steps:
                acc["wall_time_s"] += time.perf_counter() - t_loop
                t_loop = time.perf_counter()
                nb, ne = (b + 1, epoch) if b + 1 < len(batches) else (0, epoch + 1)
                save_checkpoint(ckpt_dir, inner, opt, sched,
                                {"epoch": ne, "batch": nb, "step": step, "acc": acc,
                                 "fingerprint": fp}, d)
                t_loop = time.perf_counter()
            if done and step < total_steps:
                stopped_early = True
                if ckpt_dir is not None and ckpt_every > 0 and step % ckpt_every:
                    nb, ne = (b + 1, epoch) if b + 1 < len(batches) else (0, epoch + 1)
                    acc["wall_time_s"] += time.perf_counter() - t_loop
                    save_checkpoint(ckpt_dir, inner, opt, sched,
                                    {"epoch": ne, "batch": nb, "step": step, "acc": acc,
                                     "fingerprint": fp}, d)
                    t_loop = time.perf_counter()
                break
        if stopped_early:
            break
    if d.initialized:
        dist.barrier()
    acc["wall_time_s"] += time.perf_counter() - t_loop
    pace.close()
    metrics = summarize(acc, cfg, d, distribution, examples, steps_per_epoch, epochs, step,
                        resumed_from, stopped_early)
    metrics["precision"] = precision
    metrics["hardware"] = hardware.describe()
    return metrics


def summarize(acc: dict, cfg: dict, d: Dist, distribution: str, examples: list[dict],
              steps_per_epoch: int, epochs: int, steps: int, resumed_from: int | None,
              stopped_early: bool) -> dict:
    """Turn the per-step accumulators into train_metrics.json's fields."""
    bs = rank_batch_size(cfg, d.world_size)
    losses = acc["losses"]
    every = max(1, int(cfg["log_every"]))
    curve_steps = list(range(every, steps + 1, every)) or ([steps] if steps else [])
    curve = [float(np.mean(losses[max(0, s - every):s])) for s in curve_steps]
    epoch_losses = [float(np.mean(losses[e * steps_per_epoch:(e + 1) * steps_per_epoch]))
                    for e in range(math.ceil(steps / steps_per_epoch))]
    per_rank = acc["per_rank_tokens_per_step"]
    tok = np.asarray(per_rank, dtype=np.float64) if per_rank else np.zeros((0, d.world_size))
    imbalance = (tok.max(1) / np.maximum(tok.mean(1), 1)).tolist() if len(tok) else []
    return {
        "wall_time_s": round(acc["wall_time_s"], 4),
        "steps": steps,
        "steps_per_epoch": steps_per_epoch,
        "epochs": epochs,
        "tokens": int(tok.sum()),
        "loss_tokens": int(np.sum(acc["per_rank_loss_tokens_per_step"])),
        "padded_tokens": int(np.sum(acc["padded_tokens_per_step"])),
        "examples": len(examples),
        "world_size": d.world_size,
        "batch_size": bs,
        "global_batch_size": bs * d.world_size,
        "distribution": distribution,
        "finetune": cfg["finetune"],
        "per_rank_tokens_per_step": per_rank,
        "padded_tokens_per_step": acc["padded_tokens_per_step"],
        "per_rank_loss_tokens_per_step": acc["per_rank_loss_tokens_per_step"],
        "token_imbalance_mean": float(np.mean(imbalance)) if imbalance else None,
        "mean_step_time_s": float(np.mean(acc["step_times"])) if acc["step_times"] else None,
        "final_loss": float(np.mean(losses[-every:])) if losses else None,
        "loss_curve": curve,
        "loss_curve_steps": curve_steps,
        "epoch_losses": epoch_losses,
        "resumed_from_step": resumed_from,
        "stopped_early": stopped_early,
    }


def run_train(model_dir: str | os.PathLike, pool: str | os.PathLike, selection: str | os.PathLike,
              out_dir: str | os.PathLike, metrics_path: str | os.PathLike, distribution: str = "random",
              seed: int = 0, cfg: dict | None = None, job_threads: int | None = None) -> dict:
    """Fine-tune and save; works in one process (world 1) or on every rank under torchrun.

    ``job_threads``: CPU threads the whole job may use on this node (see :func:`set_threads`).
    Returns the metrics dict (also written to ``metrics_path`` by rank 0).
    """
    t_total = time.perf_counter()
    set_offline_env()
    cfg = train_config(cfg)
    if distribution not in DISTRIBUTIONS:
        raise InputError(f"unknown distribution '{distribution}' ({'|'.join(DISTRIBUTIONS)})",
                         field="distribution")
    from .models import load_tokenizer, resolve_model

    model_dir = resolve_model(str(model_dir), field="model")
    d = setup_distributed(cfg)
    try:
        rank_batch_size(cfg, d.world_size)  # before any loading
        threads = set_threads(cfg, d, job_threads)
        seed_everything(seed)
        tokenizer = load_tokenizer(model_dir)
        pool_records = read_jsonl(pool)
        records, clusters = select_records(pool_records, read_selection(selection),
                                           str(pool), str(selection))
        line_of = {r.get("id"): i + 1 for i, r in enumerate(pool_records)}
        examples, rejected = encode_records(tokenizer, records, int(cfg["max_length"]),
                                            cfg["truncation"], where=str(pool),
                                            lines=[line_of[r["id"]] for r in records])
        if rejected:
            keep = np.setdiff1d(np.arange(len(records)), rejected)
            clusters = clusters[keep]
        if not examples:
            raise InputError(f"all {len(records)} selected records (pool lines "
                             f"{line_of[records[0]['id']]}-{line_of[records[-1]['id']]}) are longer "
                             f"than max_length = {cfg['max_length']} and truncation = 'reject' "
                             "dropped them: nothing left to train on", path=str(pool),
                             field="train.max_length")
        model = load_model(model_dir, cfg)
        seed_everything(seed * 1000 + d.rank)  # per-rank dropout streams
        ckpt_dir = Path(str(out_dir).rstrip("/") + ".ckpt") if int(cfg["checkpoint_every"]) > 0 else None
        metrics = train_loop(model, tokenizer, examples, clusters, cfg, d, distribution, seed, ckpt_dir)
        metrics.update({
            "total_time_s": round(time.perf_counter() - t_total, 4),
            "rejected_examples": len(rejected),
            "truncated_examples": int(sum(e["truncated"] for e in examples)),
            "threads_per_rank": threads,
            "device": str(d.device),
            "backend": _backend(d),
            "seed": seed,
        })
        if d.rank == 0:
            save_model_dir(model, tokenizer, out_dir)
            metrics["total_time_s"] = round(time.perf_counter() - t_total, 4)
            write_json(metrics_path, metrics)
            if ckpt_dir is not None and not metrics["stopped_early"] and ckpt_dir.exists():
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        if d.initialized:
            import torch.distributed as dist

            dist.barrier()
        return metrics
    finally:
        if d.initialized:
            import torch.distributed as dist

            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusterft.train", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="base model dir (HF)")
    ap.add_argument("--pool", required=True, help="pool.jsonl")
    ap.add_argument("--selection", required=True, help="selection.parquet (id, cluster, score)")
    ap.add_argument("--out", required=True, help="output model dir")
    ap.add_argument("--metrics", required=True, help="output train_metrics.json")
    ap.add_argument("--distribution", choices=DISTRIBUTIONS, default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="train config: YAML/JSON file or inline JSON")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads this job may use on this node, shared by its ranks "
                         "(default: the available cores; config num_threads overrides)")
    args = ap.parse_args(argv)
    die_with_launcher()
    try:
        run_train(args.model, args.pool, args.selection, args.out, args.metrics,
                  args.distribution, args.seed, parse_config_arg(args.config), args.threads)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    freeze_for_exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
