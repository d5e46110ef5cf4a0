"""Data-parallel fine-tuning (DDP) of a base model on a selected subset of the pool.

Run one process per rank with torchrun::

    torchrun --standalone --nproc-per-node N -m clusterft.stages.train --model DIR --pool POOL \
        --selection SEL.parquet --out OUT_DIR --metrics OUT.json \
        --distribution DIST --seed S --config CFG

or call :func:`run_train` in a single process (world size 1, no process group). The
global batch is ``global_batch_size`` when set (each rank takes its share, so every rank
count trains the same optimiser steps and only the split of the work differs), else the
per-rank ``batch_size`` times the world size (more ranks take fewer, larger steps).
``distribution: random`` shards with ``DistributedSampler(shuffle=True)``; ``balanced``
with ``ClusterBalancedSampler`` (clusters from the selection, lengths = token counts).
Rank 0 saves the model dir (a LoRA run's peft adapter, or the plain model; with
``keep_model: false``, which the workflow sets for runs that are only timed, just
``NOT_KEPT.json``) and ``train_metrics.json``.
Each rank's step batch runs as length-sorted micro-batches with the LM head applied only
at labelled positions (``clusterft.modeling.microbatch``): the gradient of the padded batch, with
less padding and head work (``group_cost_tokens``, ``sparse_logits``).

For models that do not fit plain DDP, ``gradient_checkpointing`` recomputes the decoder
layers in the backward pass and ``fsdp`` shards weights, gradients and optimiser state with
torch's ``fully_shard`` (both off by default; docs/scale.md). Jobs on several nodes are
launched by :mod:`clusterft.pipeline.launch` (``gpus_per_node``); this module sees only torchrun's
ranks.

A selection with an ``epoch`` column (RS2, Okanovic et al. 2023: a fresh random subset of
the budget's size every epoch; see :func:`clusterft.pools.poolfile.read_selection`) holds E subsets
of equal size: training epoch e uses subset ``e mod E``, so a run with more epochs than the
selection holds cycles through them again and a run with fewer uses the first ones. Each
epoch's sampler is built on that subset alone (its records in pool order, its clusters and
lengths) exactly as it would be for a fixed selection of it, and is set to the training
epoch; steps per epoch, the schedule's total and checkpoints are as for one subset. Every
distinct record is tokenised once. ``train_metrics.json`` records ``selection_epochs`` (E,
or null for a fixed selection), ``distinct_examples`` (ids drawn over the whole run, all
ranks) and ``epoch_ids_sha1`` (per training epoch run, the SHA-1 of the sorted ids its
batches drew, newline-joined: compare with a selection's subsets).
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from clusterft.modeling import checkpoint, cpu_matmul
from clusterft.pipeline import hardware
from clusterft.pipeline.sections import merge_section, parse_section_arg
from clusterft.modeling.distributed import (BACKENDS, DEVICES, Dist, barrier, die_with_launcher, gather_object,
                          gather_rows, mean_over_ranks, seed_everything, set_threads)
from clusterft.pipeline.errors import InputError
from clusterft.modeling.hf import (load_causal_lm, load_tokenizer, resolve_model,
                                   save_adapter_dir, save_model_dir, save_not_kept, saved_bytes,
                                   weights_digest)
from clusterft.pipeline import provenance
from clusterft.pipeline.io import set_offline_env, write_json
from clusterft.modeling.lora import DEFAULTS as LORA_DEFAULTS
from clusterft.pipeline.names import BALANCED, DISTRIBUTIONS, RANDOM_SPLIT
from clusterft.modeling.optim import SCHEDULES
from clusterft.pools.poolfile import epoch_subsets, load_pool, read_selection, select_records
from clusterft.modeling.precision import PRECISIONS, resolve_precision
from clusterft.pipeline.runtime import end_rank, freeze_for_exit
from clusterft.modeling.tokenize import LENGTH_POLICY, POLICIES, encode_records
from clusterft.modeling.lengths import DEFAULT_CAP, DEFAULT_QUANTILE, is_auto, resolve_lengths
from clusterft.modeling.lengths import check_keys as check_lengths

FINETUNE = ("full", "lora")
STEP_BUDGETS = ("selection", "pool")

DEFAULTS: dict = {
    # full: train every weight; lora: train LoRA adapters on a frozen base (saved as a peft
    # adapter folder that evaluation loads over the base, unless merge_lora).
    "finetune": "full",
    # LoRA runs: false saves the peft adapter alone (megabytes; its adapter_config.json names
    # the base folder), true a merged full copy of the model (the base's size, per run).
    "merge_lora": False,
    # false: the model folder holds only NOT_KEPT.json (why, the run, the bytes the weights
    # would have taken), no weights. The workflow sets it for the runs that are only timed
    # (the sweep's GPU-count x distribution runs, whose train metrics are all the report
    # reads; nothing evaluates them); a config cannot turn it off for the evaluated runs.
    "keep_model": True,
    # Peak AdamW learning rate.
    "lr": 1.0e-3,
    # AdamW weight decay.
    "weight_decay": 0.0,
    # Fraction of the total optimiser steps spent on linear warm-up.
    "warmup_ratio": 0.05,
    # Decay after warm-up: linear | cosine | constant (decays to 10% of lr).
    "schedule": "linear",
    # Passes over the selected data. A selection with E epoch subsets (RS2) trains epoch e on
    # subset e mod E: more epochs than E cycle through them, fewer use the first ones.
    "epochs": 3,
    # What the epochs count: selection = `epochs` passes over the selection (the paper's
    # protocol: a 31% selection takes 31% of full data's steps) | pool = as many optimiser
    # steps as `epochs` passes over the WHOLE pool would take, cycling over the selection
    # (the last pass cut short): the step-matched arm, where every budget gets full data's
    # compute, so a difference between budgets is one of data, not of steps.
    "step_budget": "selection",
    # Examples per rank per step (global batch = batch_size * world_size); ignored when
    # global_batch_size is set.
    "batch_size": 8,
    # Examples per optimiser step over all ranks; each rank takes global_batch_size /
    # world_size (it must divide), so every GPU count trains the same steps on the same
    # global batches. null: batch_size per rank.
    "global_batch_size": None,
    # Longest example in tokens (prompt + response + BOS/EOS). auto: measured from the whole
    # pool (not only the selection), as score.max_length auto (clusterft.modeling.lengths);
    # train_metrics.json records the value.
    "max_length": LENGTH_POLICY["max_length"],
    # max_length auto: the share of the pool's examples that fit uncut.
    "max_length_quantile": DEFAULT_QUANTILE,
    # max_length auto: never more than this many tokens (nor the model's context).
    "max_length_cap": DEFAULT_CAP,
    # Longer examples: truncate (cut the response end; see clusterft.modeling.tokenize; counted in
    # train_metrics truncated_examples) | reject (drop; counted in rejected_examples) | error
    # (stop, naming the pool file, line and record id). score checks the whole pool against
    # this first, so error (or a pool that reject would empty) stops before gradient work.
    "truncation": LENGTH_POLICY["truncation"],
    # Length-grouped micro-batches: each rank's step batch is sorted by length and cut into
    # groups padded separately (same gradient, less padding; clusterft.modeling.microbatch). The cut
    # minimises padded tokens + this cost per extra group; -1 = one padded batch per step.
    # A GPU, where a small group wastes the device, wants a larger cost than a CPU.
    "group_cost_tokens": 256,
    # Pad each micro-batch to a multiple of this many tokens (1 = to its longest). Fewer
    # distinct shapes: oneDNN's bf16 kernels on CPU are built per shape, and GPUs like
    # multiples of 8.
    "pad_to_multiple_of": 1,
    # auto | bf16 | fp32: bf16 autocasts matmuls to bfloat16 (trained weights, optimiser and
    # loss stay float32; a frozen LoRA base on a CUDA GPU is loaded in bfloat16, half the
    # memory: clusterft.modeling.precision.base_dtype); auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU (CPUs without native
    # bf16 emulate it, much slower: clusterft.modeling.precision.resolve_precision).
    # train_metrics.json records the precision.
    "precision": "auto",
    # Apply the LM head only where a next token has a label (the response), for
    # architectures where that is exact (llama, mistral, qwen2, qwen3); false = full logits.
    "sparse_logits": True,
    # Packed micro-batches (clusterft.modeling.packing): each rank's step examples
    # concatenated into one row, position ids restarting per example and attention kept
    # inside each (no padding; the same loss and gradient). auto (or null, the default):
    # packed where that is exact (llama, mistral, qwen2, qwen3 without sliding window;
    # flash-attn's varlen kernels on a CUDA GPU that has flash-attn, else sdpa over
    # length-grouped blocks); true: packed or an error; false: padded micro-batches
    # (group_cost_tokens). train_metrics.json records which ran (packing: true/false).
    "packing": None,
    # Gradient-norm clip (0 disables).
    "grad_clip": 1.0,
    # LoRA settings (used when finetune: lora; keys in clusterft.modeling.lora).
    "lora": copy.deepcopy(LORA_DEFAULTS),
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
    # Ranks per node for multi-node jobs (clusterft.pipeline.launch): a job of G GPUs runs on
    # G / gpus_per_node nodes (it must divide), one torchrun agent per node under SLURM
    # (srun, c10d rendezvous on the allocation's first node). 0 = every rank on one node.
    "gpus_per_node": 0,
    # Recompute each decoder layer's activations in the backward pass instead of keeping
    # them (less memory, about one more forward of compute; the same gradients).
    "gradient_checkpointing": False,
    # Shard parameters, gradients and optimiser state over the ranks with torch's FSDP
    # (torch.distributed.fsdp.fully_shard, one unit per decoder layer) instead of DDP, for
    # models whose weights + AdamW state do not fit one GPU. Needs >= 2 ranks and
    # finetune: full; checkpoint_every must stay 0 (FSDP runs are not resumable yet).
    "fsdp": False,
}



# --------------------------------------------------------------------------- config

def train_config(cfg: dict | None) -> dict:
    """Merge ``cfg`` over DEFAULTS; unknown keys and bad values raise InputError."""
    from clusterft.modeling import lora
    from clusterft.modeling.packing import check_setting as check_packing

    out = merge_section(DEFAULTS, cfg, "train")
    if not isinstance(out["keep_model"], bool):
        raise InputError(f"must be true or false, got {out['keep_model']!r}",
                         field="train.keep_model")
    for key, valid in (("finetune", FINETUNE), ("precision", PRECISIONS),
                       ("truncation", POLICIES), ("schedule", SCHEDULES),
                       ("backend", BACKENDS), ("device", DEVICES),
                       ("step_budget", STEP_BUDGETS)):
        if out[key] not in valid:
            raise InputError(f"{key} must be one of {'|'.join(valid)}, got '{out[key]}'",
                             field=f"train.{key}")
    check_lengths(out, "train")
    for k in ("epochs", "batch_size", "max_length", "pad_to_multiple_of"):
        if not is_auto(out[k]) and int(out[k]) < 1:
            raise InputError(f"{k} must be >= 1, got {out[k]}", field=f"train.{k}")
    gbs = out["global_batch_size"]
    if gbs is not None and (isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1):
        raise InputError(f"global_batch_size must be a positive integer or null, got {gbs!r}",
                         field="train.global_batch_size")
    lora.check(out["lora"], "train.lora")
    out["packing"] = check_packing(out["packing"], "train.packing")
    if int(out["gpus_per_node"]) < 0:
        raise InputError(f"gpus_per_node must be >= 0 (0: one node), got {out['gpus_per_node']}",
                         field="train.gpus_per_node")
    if out["fsdp"]:
        if out["finetune"] != "full":
            raise InputError("fsdp: true needs finetune: full (LoRA adapters under FSDP are not "
                             "supported; LoRA's few trainable weights fit plain DDP)",
                             field="train.fsdp")
        if int(out["checkpoint_every"]) > 0:
            raise InputError("checkpoint_every > 0 with fsdp: true: FSDP runs cannot be "
                             "checkpointed and resumed yet; set checkpoint_every: 0 or fsdp: false",
                             field="train.checkpoint_every")
    return out


def step_plan(subset_steps: list[int], epochs: int, steps: int | None = None) -> list[int]:
    """Steps of each training epoch: ``epochs`` passes (epoch e over subset e mod the
    subsets), or, given ``steps``, as many passes as make ``steps`` in all, the last one cut
    short (a pass of 0 steps, from an empty subset, cannot reach them)."""
    if steps is None:
        return [subset_steps[e % len(subset_steps)] for e in range(epochs)]
    if steps < 1 or not any(subset_steps):
        raise InputError(f"cannot train {steps} steps over subsets of {subset_steps} steps",
                         field="train.step_budget")
    out: list[int] = []
    while sum(out) < steps:
        out.append(min(subset_steps[len(out) % len(subset_steps)], steps - sum(out)))
    return out


def pool_steps(n_pool: int, cfg: dict, world_size: int) -> int:
    """Optimiser steps of ``cfg['epochs']`` passes over a whole pool of ``n_pool`` examples
    (step_budget: pool): what full data trains, at this batch size."""
    return int(cfg["epochs"]) * math.ceil(n_pool / (rank_batch_size(cfg, world_size) * world_size))


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


# --------------------------------------------------------------------------- data and model

def load_examples(tokenizer, pool: str | os.PathLike, selection: str | os.PathLike,
                  cfg: dict) -> tuple[list[dict], np.ndarray, int]:
    """The selected pool records, tokenised under the length policy: (examples, their
    cluster ids, how many the policy rejected). For a selection with epochs, every distinct
    record once (:func:`load_selection` also says which each epoch holds)."""
    return load_selection(tokenizer, pool, selection, cfg)[:3]


def load_selection(tokenizer, pool: str | os.PathLike, selection: str | os.PathLike,
                   cfg: dict) -> tuple[list[dict], np.ndarray, int, list[np.ndarray] | None]:
    """:func:`load_examples` plus the epoch subsets: (examples, clusters, rejected count,
    subsets) where ``subsets`` is None for a fixed selection, else per selection epoch the
    ascending indices into ``examples`` of its records (those the length policy kept).
    Each distinct record is tokenised once, however many epochs hold it."""
    sel = read_selection(selection)
    records, clusters, lines = select_records(load_pool(pool), sel, str(pool), str(selection))
    subsets = epoch_subsets(sel, records)
    examples, rejected = encode_records(tokenizer, records, int(cfg["max_length"]),
                                        cfg["truncation"], where=str(pool), lines=lines)
    if rejected:
        kept = np.setdiff1d(np.arange(len(records)), rejected)
        clusters = clusters[kept]
        if subsets is not None:
            new = np.full(len(records), -1, dtype=np.int64)
            new[kept] = np.arange(len(kept))
            subsets = [new[s][new[s] >= 0] for s in subsets]
    if not examples:
        raise InputError(f"all {len(records)} selected records (pool lines "
                         f"{lines[0]}-{lines[-1]}) are longer than max_length = "
                         f"{cfg['max_length']} and truncation = 'reject' dropped them: nothing "
                         "left to train on", path=str(pool), field="train.max_length")
    return examples, clusters, len(rejected), subsets


def load_model(model_dir: str, cfg: dict, device=None):
    """Load the base model and wrap it with LoRA adapters if finetune: lora. float32, except a
    frozen LoRA base on a CUDA device in bf16 (not under FSDP), which loads in bfloat16
    straight onto ``device``."""
    from clusterft.modeling.lora import add_lora
    from clusterft.modeling.precision import base_dtype

    dtype = None
    if device is not None and str(device).startswith("cuda") and not cfg.get("fsdp"):
        precision = resolve_precision(cfg["precision"], device, field="train.precision")
        dtype = base_dtype(precision, device, cfg["finetune"])
    model = load_causal_lm(model_dir, dtype=dtype, device=device)
    model.config.use_cache = False
    if cfg["finetune"] == "lora":
        model = add_lora(model, cfg["lora"], "train.lora")  # init from the seeded global RNG
    return model


# --------------------------------------------------------------------------- training

def train_loop(model, tokenizer, examples: list[dict], clusters: np.ndarray, cfg: dict, d: Dist,
               distribution: str, seed: int, ckpt_dir: Path | None = None,
               run_name: str = "train", subsets: list[np.ndarray] | None = None,
               steps: int | None = None) -> dict:
    """Fine-tune ``model`` in place on ``examples``; returns the metrics (same on every rank).
    ``subsets`` (RS2): per selection epoch, indices into ``examples``; training epoch e
    trains on subset ``e mod len(subsets)`` (None: every epoch on all of ``examples``).
    ``steps``: train exactly this many optimiser steps (``step_plan``) instead of
    ``cfg['epochs']`` passes.
    A loss or gradient that stops being finite raises DivergedError naming ``run_name``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clusterft.modeling.microbatch import CausalLMLoss, backward_step, label_count
    from clusterft.modeling.optim import CLIP_OR_FP32, adamw, check_finite
    from clusterft.modeling.packing import resolve_packing
    from clusterft.pipeline.pace import Pace
    from clusterft.sampler import epoch_batches, make_sampler
    from clusterft.modeling.tokenize import Collator

    # Data order: every rank must take the same number of steps, or DDP hangs. One sampler
    # per subset (one subset, all examples, for a fixed selection), built on its examples.
    bs = rank_batch_size(cfg, d.world_size)
    lengths = np.asarray([e["length"] for e in examples], dtype=np.int64)
    views = [np.arange(len(examples))] if subsets is None else [np.asarray(s, dtype=np.int64)
                                                                 for s in subsets]
    samplers = [make_sampler(distribution, clusters[v], lengths[v], d.world_size, d.rank, bs,
                             seed, bool(cfg["drop_last"])) if len(v) else None for v in views]
    subset_steps = [math.ceil(len(s) / bs) if s is not None else 0 for s in samplers]
    counts = gather_object(d, subset_steps)
    if any(c != counts[0] for c in counts):
        raise RuntimeError(f"ranks disagree on steps per epoch: {counts} (sampler bug)")
    epoch_steps = step_plan(subset_steps, int(cfg["epochs"]), steps)
    epochs = len(epoch_steps)
    total_steps = sum(epoch_steps)
    if total_steps == 0:
        raise InputError("no training steps (selection smaller than one batch with drop_last)",
                         field="train.drop_last")
    max_steps, ckpt_every = int(cfg["max_steps"]), int(cfg["checkpoint_every"])

    # Model, optimiser, schedule; then the checkpoint of this very run, if one was left.
    model = model.to(d.device)
    if cfg["gradient_checkpointing"]:
        enable_gradient_checkpointing(model)
    fsdp = bool(cfg["fsdp"])
    packed = resolve_packing(cfg["packing"], model)
    if fsdp:  # the optimiser must see the sharded parameters
        loss_fn = shard(CausalLMLoss(model, sparse_logits=bool(cfg["sparse_logits"]),
                                     packing=packed), model)
        params = [p for p in loss_fn.parameters() if p.requires_grad]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    # What each rank holds of the trained weights (FSDP: its shards, about 1/world each).
    held = gather_object(d, int(sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                    for p in params)))
    opt, sched = adamw(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                       schedule=cfg["schedule"], warmup=round(float(cfg["warmup_ratio"]) * total_steps),
                       total=total_steps, field="train.schedule")
    ids = [str(e.get("id")) for e in examples]
    if subsets is not None:  # which examples each epoch holds is part of the data
        ids += [f"#epoch {k}: " + ",".join(map(str, v.tolist())) for k, v in enumerate(views)]
    fp = checkpoint.fingerprint(cfg, d.world_size, distribution, seed, ids)
    log: dict[str, Any] = {"per_rank_tokens_per_step": [], "padded_tokens_per_step": [],
                           "per_rank_loss_tokens_per_step": [], "losses": [], "step_times": [],
                           "wall_time_s": 0.0}
    start_epoch, start_batch, step, resumed_from = 0, 0, 0, None
    blob = checkpoint.load(ckpt_dir, fp, d) if ckpt_dir is not None else None
    if blob is not None:
        checkpoint.restore(blob, model, opt, sched, d)
        start_epoch, start_batch, step, log = blob["epoch"], blob["batch"], blob["step"], blob["acc"]
        resumed_from = step

    if fsdp:
        ddp = loss_fn  # FSDP reduce-scatters (averages) each micro-batch's gradient shards
    else:
        loss_fn = CausalLMLoss(model, sparse_logits=bool(cfg["sparse_logits"]), packing=packed)
        ddp = DDP(loss_fn, device_ids=[d.device.index] if d.device.type == "cuda" else None) \
            if d.initialized else loss_fn
    pad_multiple = int(cfg["pad_to_multiple_of"])
    collate = Collator(tokenizer.pad_token_id, pad_multiple)
    precision = resolve_precision(cfg["precision"], d.device, field="train.precision")
    ddp.train()
    # Not a `with` block: a failed step ends the process, and the loop stays flat.
    pace = Pace(min(total_steps, max_steps) if max_steps else total_steps,
                f"train x{d.world_size} ({precision})", initial=step,
                disable=d.rank != 0, mininterval=1.0)
    stopped_early = False
    t_loop = time.perf_counter()
    # Example indices this rank drew, per training epoch (for distinct_examples); a resumed
    # run recounts the steps done before the checkpoint from the same deterministic plans.
    drawn: list[set[int]] = [set() for _ in range(epochs)]
    for epoch in range(epochs):
        view, sampler = views[epoch % len(views)], samplers[epoch % len(views)]
        batches = [] if sampler is None else epoch_batches(sampler, epoch, bs)
        if subsets is not None:
            batches = [view[b].tolist() for b in batches]
        batches = batches[:epoch_steps[epoch]]  # the last pass of a step budget is cut
        first = start_batch if epoch == start_epoch else 0 if epoch > start_epoch else len(batches)
        for done in batches[:first]:
            drawn[epoch].update(done)
        for b in range(first, len(batches)):
            t_step = time.perf_counter()
            drawn[epoch].update(batches[b])
            step_examples = [examples[i] for i in batches[b]]
            labels_here = sum(label_count(e) for e in step_examples)
            # Mean over the global batch's label tokens: DDP averages the ranks' gradients,
            # so each rank divides by (global label count / world size), and the step's
            # gradient does not depend on how the batch is split.
            denom = mean_over_ranks(d, labels_here)
            loss_val, real, padded = backward_step(
                ddp, step_examples, collate, float(cfg["group_cost_tokens"]), d.device,
                precision == "bf16", no_sync=ddp.no_sync if d.initialized and not fsdp else None,
                denom=denom, pad_to_multiple_of=pad_multiple, packed=packed)
            # The gradients are summed over the ranks by now, so every rank sees the same norm
            # and stops together (a NaN loss on one rank makes every rank's gradient NaN).
            if float(cfg["grad_clip"]) > 0:
                norm = full_float(torch.nn.utils.clip_grad_norm_(params, float(cfg["grad_clip"])))
            else:
                norm = full_float(torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None]))
            check_finite(None, norm, step=step + 1, total=total_steps, run=run_name,
                         lr_field="train.lr", lr=float(cfg["lr"]), hint=CLIP_OR_FP32,
                         checkpoint=str(ckpt_dir) if ckpt_dir is not None and ckpt_dir.exists() else None)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            record_step(log, gather_rows(d, [real, padded, labels_here, loss_val]),
                        time.perf_counter() - t_step)
            step += 1
            pace.update()
            if step % max(1, int(cfg["log_every"])) == 0:
                pace.set_postfix(loss=f"{log['losses'][-1]:.3f}")
            stopped_early = bool(max_steps) and max_steps <= step < total_steps
            if ckpt_dir is not None and ckpt_every > 0 and step < total_steps \
                    and (step % ckpt_every == 0 or stopped_early):
                log["wall_time_s"] += time.perf_counter() - t_loop
                at = (epoch, b + 1) if b + 1 < len(batches) else (epoch + 1, 0)
                checkpoint.save(ckpt_dir, model, opt, sched,
                                {"epoch": at[0], "batch": at[1], "step": step, "acc": log,
                                 "fingerprint": fp}, d)
                t_loop = time.perf_counter()
            if stopped_early:
                break
        if stopped_early:
            break
    barrier(d)
    log["wall_time_s"] += time.perf_counter() - t_loop
    pace.close()
    loss_fn.release()  # the model's attention as it was before packing
    metrics = summarize(log, cfg, d, distribution, len(views[0]), epoch_steps, epochs, step,
                        resumed_from, stopped_early)
    metrics.update(drawn_metrics(gather_object(d, [sorted(s) for s in drawn]), examples))
    metrics["selection_epochs"] = None if subsets is None else len(subsets)
    metrics["step_budget"] = cfg["step_budget"]
    metrics["precision"] = precision
    metrics["packing"] = packed  # packed rows (true) or padded micro-batches (false)
    metrics["trainable_params_per_rank"] = held
    metrics["fsdp"], metrics["gradient_checkpointing"] = fsdp, bool(cfg["gradient_checkpointing"])
    metrics["hardware"] = hardware.describe()
    metrics["cpu_matmul"] = cpu_matmul.active()  # the kernel of float32 CPU linears
    return metrics


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass (transformers' own, non-reentrant:
    the same gradients, dropout included, with a layer's activations freed after its
    forward)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise InputError(f"{type(model).__name__} does not support gradient checkpointing",
                         field="train.gradient_checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def shard(loss_fn, model):
    """FSDP (torch's ``fully_shard``): one unit per decoder layer, the rest (embeddings,
    final norm, LM head, tied or not) in the root unit around ``loss_fn``. Returns
    ``loss_fn``, now sharded over the process group's ranks."""
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(model.get_decoder(), "layers", None) or []:
        fully_shard(layer)
    fully_shard(loss_fn)
    return loss_fn


def full_float(value) -> float:
    """A scalar that may be a DTensor (a norm over FSDP-sharded gradients) as a float."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def unsharded_copy(model, model_dir: str, cfg: dict):
    """A plain copy of an FSDP-trained ``model`` with its full weights (every rank gathers
    every weight, in the same order; for rank 0 to save)."""
    from torch.distributed.tensor import DTensor

    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
             for k, v in model.state_dict().items()}
    plain = load_model(model_dir, cfg)
    plain.load_state_dict(state)
    return plain


def record_step(log: dict, rows: list[list[float]], seconds: float) -> None:
    """Add one step's per-rank [tokens, padded tokens, label tokens, loss] rows to the log."""
    log["per_rank_tokens_per_step"].append([int(r[0]) for r in rows])
    log["padded_tokens_per_step"].append([int(r[1]) for r in rows])
    log["per_rank_loss_tokens_per_step"].append([int(r[2]) for r in rows])
    log["losses"].append(float(np.mean([r[3] for r in rows])))
    log["step_times"].append(seconds)


def drawn_metrics(per_rank: list[list[list[int]]], examples: list[dict]) -> dict:
    """``distinct_examples`` and ``epoch_ids_sha1`` from every rank's example indices drawn
    per training epoch (epochs after the last one that drew anything are left out)."""
    epochs = [set().union(*(r[e] for r in per_rank)) for e in range(len(per_rank[0]))]
    while epochs and not epochs[-1]:
        epochs.pop()
    return {"distinct_examples": len(set().union(*epochs)),
            "epoch_ids_sha1": [ids_sha1(examples[i].get("id") for i in s) for s in epochs]}


def ids_sha1(ids) -> str:
    """The ``epoch_ids_sha1`` entry of an epoch that drew ``ids`` (any order, repeats ok)."""
    return hashlib.sha1("\n".join(sorted(set(map(str, ids)))).encode()).hexdigest()


def summarize(acc: dict, cfg: dict, d: Dist, distribution: str, n_examples: int,
              epoch_steps: list[int], epochs: int, steps: int, resumed_from: int | None,
              stopped_early: bool) -> dict:
    """Turn the per-step accumulators into train_metrics.json's fields. ``n_examples``:
    examples per epoch (an RS2 selection's first subset); ``epoch_steps``: each training
    epoch's steps (all equal, unless the length policy rejected examples from some RS2
    subsets and not others); ``steps_per_epoch`` reports the first."""
    bs = rank_batch_size(cfg, d.world_size)
    losses = acc["losses"]
    every = max(1, int(cfg["log_every"]))
    curve_steps = list(range(every, steps + 1, every)) or ([steps] if steps else [])
    curve = [float(np.mean(losses[max(0, s - every):s])) for s in curve_steps]
    starts = np.concatenate([[0], np.cumsum(epoch_steps)]).tolist()
    epoch_losses = [float(np.mean(losses[a:b])) if b > a else None
                    for a, b in zip(starts[:-1], starts[1:]) if a < steps]
    per_rank = acc["per_rank_tokens_per_step"]
    tok = np.asarray(per_rank, dtype=np.float64) if per_rank else np.zeros((0, d.world_size))
    imbalance = (tok.max(1) / np.maximum(tok.mean(1), 1)).tolist() if len(tok) else []
    return {
        "wall_time_s": round(acc["wall_time_s"], 4),
        "steps": steps,
        "steps_per_epoch": epoch_steps[0],
        "epochs": epochs,
        "tokens": int(tok.sum()),
        "loss_tokens": int(np.sum(acc["per_rank_loss_tokens_per_step"])),
        "padded_tokens": int(np.sum(acc["padded_tokens_per_step"])),
        "examples": n_examples,
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
              out_dir: str | os.PathLike, metrics_path: str | os.PathLike, distribution: str = RANDOM_SPLIT,
              seed: int = 0, cfg: dict | None = None, job_threads: int | None = None) -> dict:
    """Fine-tune and save; works in one process (world 1) or on every rank under torchrun.

    ``job_threads``: CPU threads the whole job may use on this node
    (:func:`clusterft.modeling.distributed.set_threads`). Returns the metrics dict (also written to
    ``metrics_path`` by rank 0).
    """
    from clusterft.modeling import distributed

    t_total = time.perf_counter()
    set_offline_env()
    cpu_matmul.from_env()
    cfg = train_config(cfg)
    if distribution not in DISTRIBUTIONS:
        raise InputError(f"unknown distribution '{distribution}' ({'|'.join(DISTRIBUTIONS)})",
                         field="distribution")
    model_dir = resolve_model(str(model_dir), field="model")
    checked = provenance.check_inputs({"model": model_dir, "pool": pool, "selection": selection},
                                      "train")
    d = distributed.setup(cfg["device"], cfg["backend"])
    try:
        rank_batch_size(cfg, d.world_size)  # before any loading
        if cfg["fsdp"] and d.world_size < 2:
            raise InputError("fsdp: true needs at least 2 ranks (this job has 1): shard over "
                             "2 or more GPUs, or set fsdp: false", field="train.fsdp")
        threads = set_threads(cfg["num_threads"], d, job_threads)
        seed_everything(seed)
        tokenizer = load_tokenizer(model_dir)
        # max_length auto: from the whole pool, the same on every rank (and in score)
        # the whole pool, read at most once: max_length auto and step_budget pool need it
        pool_records = functools.cache(lambda: load_pool(pool))
        cfg, lengths = resolve_lengths(cfg, "train", tokenizer, pool_records,
                                       model_dir)
        examples, clusters, rejected, subsets = load_selection(tokenizer, pool, selection, cfg)
        model = load_model(model_dir, cfg, d.device)
        seed_everything(seed * 1000 + d.rank)  # per-rank dropout streams
        ckpt_dir = Path(str(out_dir).rstrip("/") + ".ckpt") if int(cfg["checkpoint_every"]) > 0 else None
        steps = (pool_steps(len(pool_records()), cfg, d.world_size)
                 if cfg["step_budget"] == "pool" else None)
        metrics = train_loop(model, tokenizer, examples, clusters, cfg, d, distribution, seed,
                             ckpt_dir, run_name=f"train {out_dir}", subsets=subsets,
                             steps=steps)
        if cfg["fsdp"] and cfg["keep_model"]:  # kept no model: its sizes are the DTensors'
            model = unsharded_copy(model, model_dir, cfg)
        metrics.update({
            "total_time_s": round(time.perf_counter() - t_total, 4),
            "rejected_examples": rejected,
            "truncated_examples": int(sum(e["truncated"] for e in examples)),
            "threads_per_rank": threads,
            "device": str(d.device),
            "backend": d.backend,
            "seed": seed,
            **lengths,
        })
        if d.rank == 0:
            save_model(model, tokenizer, out_dir, cfg, d.world_size, distribution, seed)
            metrics["total_time_s"] = round(time.perf_counter() - t_total, 4)
            write_json(metrics_path, metrics)
            provenance.write({"model": out_dir, "metrics": metrics_path}, "train", checked,
                             inherit=("selection", "pool"), seed=seed,
                             config={"distribution": distribution, "world_size": d.world_size,
                                     **cfg, **lengths})
            if ckpt_dir is not None and not metrics["stopped_early"] and ckpt_dir.exists():
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        barrier(d)
        return metrics
    finally:
        distributed.teardown(d)


def save_model(model, tokenizer, out_dir: str | os.PathLike, cfg: dict, world_size: int,
               distribution: str, seed: int) -> None:
    """Rank 0's save of a run's ``out_dir``: the peft adapter (LoRA, not merged), the plain
    model, or with ``keep_model: false`` only ``NOT_KEPT.json``: why, the run and the bytes
    the weights would have taken (``clusterft.modeling.hf.saved_bytes``)."""
    adapter = cfg["finetune"] == "lora" and not cfg["merge_lora"]
    if not cfg["keep_model"]:
        save_not_kept(out_dir, {
            "kept": False,
            "why": "train.keep_model is false: a run that is only timed (the sweep's GPU "
                   "count x distribution runs); nothing evaluates it, its train metrics "
                   "are what the report reads",
            "run": {"out": str(out_dir), "world_size": world_size,
                    "distribution": distribution, "seed": seed,
                    "finetune": cfg["finetune"], "merge_lora": bool(cfg["merge_lora"])},
            "would_have_saved": "peft adapter" if adapter else "model",
            "would_have_taken_bytes": saved_bytes(model, adapter),
            # the trained weights' digest: equal trainings are still told apart (FSDP:
            # not gathered, so none)
            "weights_sha256": None if cfg["fsdp"] else weights_digest(model, adapter),
        })
    elif adapter:
        save_adapter_dir(model, tokenizer, out_dir)
    else:
        save_model_dir(model, tokenizer, out_dir)


def check_runs(runs: dict[str, list]) -> int:
    """The number of runs one process trains: every per-run argument (``--selection``,
    ``--out``, ``--metrics``, ``--seed``) takes one value per run, in the same order.

    Several runs in one job share the process start-up (imports of torch and transformers,
    a second or more per job on a CPU) and run one after the other, each exactly as a job of
    its own would (its seeds set at its start). They need one rank: torchrun's ranks run one
    training each. Every selection file is checked before the first run starts.
    """
    counts = {k: len(v) for k, v in runs.items()}
    n = counts["out"]
    bad = [k for k, c in counts.items() if c != n]
    if bad:
        raise InputError("give one value per run to each of --selection, --out, --metrics and "
                         f"--seed (got {', '.join(f'{k}: {c}' for k, c in counts.items())})",
                         field=f"--{bad[0]}")
    if n > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError(f"{n} runs in one job need one rank (WORLD_SIZE is "
                         f"{os.environ['WORLD_SIZE']}): run one job per run under torchrun",
                         field="--out")
    if len(set(runs["out"])) != n:
        raise InputError("two runs write the same --out directory", field="--out")
    for sel in runs["selection"]:
        if not Path(sel).is_file():
            raise InputError("selection file does not exist", path=str(sel), field="--selection")
    return n


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Train's flags, on its own parser and on `clusterft train` alike (one set, one place)."""
    ap.add_argument("--model", required=True,
                    help="base model directory (Hugging Face format: config.json, weights, "
                         "tokenizer)")
    ap.add_argument("--pool", required=True, help="the pool (pool.jsonl) the selection's ids "
                    "come from")
    ap.add_argument("--selection", required=True, nargs="+",
                    help="selection.parquet (id, cluster, score; optional epoch: RS2 subsets); "
                         "one per run")
    ap.add_argument("--out", required=True, nargs="+",
                    help="output model directory (LoRA merged into the weights), one per run")
    ap.add_argument("--metrics", required=True, nargs="+",
                    help="output train_metrics.json, one per run")
    ap.add_argument("--distribution", choices=DISTRIBUTIONS, default=RANDOM_SPLIT,
                    help="how examples are spread over ranks and batches: "
                         f"{RANDOM_SPLIT} (DistributedSampler, shuffled) or {BALANCED} "
                         "(cluster-balanced batches); default: %(default)s")
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="one per run (several runs: one after the other in this process, "
                         "each as its own job would train it; one rank only); default: 0")
    ap.add_argument("--config", default=None,
                    help="train config: a YAML/JSON file or inline JSON (the train section's "
                         "keys, or a whole config with a train: section); default: the "
                         "built-in defaults")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads this job may use on this node, shared by its ranks "
                         "(default: the available cores; config num_threads overrides)")
    return ap


def build_parser(prog: str = "python -m clusterft.stages.train") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                                 allow_abbrev=False))


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Train the runs of parsed `add_arguments` flags; the exit status (2: bad input)."""
    die_with_launcher()
    try:
        runs = {"selection": args.selection, "out": args.out, "metrics": args.metrics,
                "seed": args.seed}
        n = check_runs(runs)
        cfg = parse_section_arg(args.config, "train")
        for i in range(n):
            if n > 1:
                print(f"run {i + 1} of {n}: seed {args.seed[i]} -> {args.out[i]}", file=sys.stderr,
                      flush=True)
            run_train(args.model, args.pool, args.selection[i], args.out[i], args.metrics[i],
                      args.distribution, args.seed[i], cfg, args.threads)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    freeze_for_exit()
    end_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
