"""Brief causal-LM pretraining of a freshly built model on packed blocks of the corpus."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np

from clusterft.modeling import cpu_matmul
from clusterft.pipeline import hardware
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path
from clusterft.modeling.optim import CLIP_OR_FP32, adamw, check_finite
from clusterft.modeling.precision import autocast, resolve_precision

log = logging.getLogger(__name__)

DEFAULTS: dict = {
    # Optimiser steps (the time knob: about linear in wall time).
    "steps": 300,
    # Tokens per packed training block.
    "block_size": 128,
    # Blocks per optimiser step.
    "batch_size": 16,
    # Peak AdamW learning rate.
    "lr": 3.0e-3,
    # AdamW weight decay.
    "weight_decay": 0.01,
    # Linear warm-up steps before the decay.
    "warmup_steps": 20,
    # Decay after warm-up: cosine or linear (to 10% of lr).
    "schedule": "cosine",
    # Gradient-norm clip (0 disables).
    "grad_clip": 1.0,
    # Torch intra-op threads (0 = leave torch's default).
    "num_threads": 0,
    # auto | bf16 | fp32: bf16 autocasts matmuls (weights and optimiser stay float32);
    # auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU (CPUs without native bf16
    # emulate it, much slower: clusterft.modeling.precision). The precision used
    # goes to pretrain_metrics.json.
    "precision": "auto",
    # Fraction of blocks held out to report a validation loss (0 disables).
    "val_fraction": 0.02,
    # Optimiser steps between resumable checkpoints (0 disables): a killed pretraining
    # resumes from the last one (<model dir>.ckpt/state.pt, removed once the model is saved)
    # to the same weights as an uninterrupted run.
    "checkpoint_every": 50,
}

# Keys that change neither the model nor the data order: a run may resume across them.
RESUMABLE_ACROSS = ("checkpoint_every", "num_threads")


def fingerprint(cfg: dict, seed: int, blocks: "np.ndarray", model_config: str) -> str:
    """What a pretraining checkpoint must match to be resumed: config, seed, data, model."""
    import hashlib
    import json

    keep = {k: v for k, v in cfg.items() if k not in RESUMABLE_ACROSS}
    blob = json.dumps({"cfg": keep, "seed": seed, "model": model_config,
                       "data": hashlib.sha1(blocks.tobytes()).hexdigest()},
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


def pack_blocks(tokenizer, texts: Iterable[str], block_size: int) -> "np.ndarray":
    """Tokenize documents as ``<s> doc </s>``, concatenate, and cut into full blocks."""
    texts = list(texts)
    ids: list[int] = []
    enc = tokenizer(texts, add_special_tokens=True)["input_ids"]
    for row in enc:
        ids.extend(row)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    if n == 0:
        raise InputError(f"corpus has {len(ids)} tokens, fewer than one block of {block_size}",
                         field="pretrain.block_size")
    return np.asarray(ids[: n * block_size], dtype=np.int64).reshape(n, block_size)


def pretrain(model, tokenizer, texts: Iterable[str], cfg: dict, seed: int = 0,
             field: str = "pretrain", ckpt_dir: str | os.PathLike | None = None) -> dict:
    """Briefly pretrain ``model`` in place as a causal LM on packed blocks; return metrics.
    ``field``: the config section of these settings, named by a divergence error;
    ``ckpt_dir``: where checkpoints go every ``checkpoint_every`` steps (and are resumed
    from, when they match this run's fingerprint)."""
    import torch

    from clusterft.pipeline.pace import Pace

    cfg = {**DEFAULTS, **(cfg or {})}
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    block = int(cfg["block_size"])
    if block > model.config.max_position_embeddings:
        raise InputError(f"block_size {block} exceeds max_position_embeddings "
                         f"{model.config.max_position_embeddings}", field="pretrain.block_size")
    blocks = pack_blocks(tokenizer, texts, block)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(blocks))
    n_val = int(len(blocks) * float(cfg["val_fraction"]))
    n_val = min(n_val, 64)
    val, train = blocks[perm[:n_val]], blocks[perm[n_val:]]
    if len(train) == 0:
        raise InputError("no training blocks left after the validation split", field="pretrain.val_fraction")
    steps, bs = int(cfg["steps"]), int(cfg["batch_size"])
    precision = resolve_precision(cfg["precision"], model.device, field="pretrain.precision")
    torch.manual_seed(seed)
    opt, sched = adamw(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                       betas=(0.9, 0.95), schedule=cfg["schedule"], warmup=cfg["warmup_steps"],
                       total=steps, field="pretrain.schedule")
    data = torch.from_numpy(train)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    order = rng.permutation(len(train))
    pos = start = 0
    every = int(cfg["checkpoint_every"]) if ckpt_dir is not None else 0
    fp = fingerprint(cfg, seed, blocks, model.config.to_json_string()) if every else ""
    state_file = Path(ckpt_dir) / "state.pt" if every else None
    if state_file is not None and state_file.exists():
        blob = torch.load(state_file, map_location="cpu", weights_only=False)
        if blob.get("fingerprint") == fp:
            model.load_state_dict(blob["model"])
            opt.load_state_dict(blob["optimizer"])
            sched.load_state_dict(blob["scheduler"])
            rng.bit_generator.state = blob["numpy"]
            torch.set_rng_state(blob["torch"])
            order, pos, losses, start = blob["order"], blob["pos"], blob["losses"], blob["step"]
            log.info("resuming pretraining from step %d of %d (%s)", start, steps, state_file)
        else:
            warnings.warn(f"{state_file}: checkpoint of a different pretraining run (config, "
                          "seed, corpus or model differ); starting from scratch", stacklevel=2)
    with Pace(steps - start, f"pretrain ({precision})", disable=steps - start < 2) as pace:
        for _step in range(start, steps):
            if pos + bs > len(order):
                order, pos = rng.permutation(len(train)), 0
            idx = torch.from_numpy(order[pos:pos + bs]) if bs <= len(order) else torch.from_numpy(order)
            pos += bs
            batch = data[idx]
            with autocast(model.device, precision):
                out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            norm = None
            if cfg["grad_clip"]:
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                            float(cfg["grad_clip"])))
            loss = float(out.loss.detach())
            check_finite(loss, norm, step=_step + 1, total=steps, run=f"pretraining ({field})",
                         lr_field=f"{field}.lr", lr=float(cfg["lr"]), hint=CLIP_OR_FP32)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
            pace.update()
            if every and (_step + 1) % every == 0 and _step + 1 < steps:
                with atomic_path(state_file) as tmp:
                    torch.save({"fingerprint": fp, "step": _step + 1, "model": model.state_dict(),
                                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                "numpy": rng.bit_generator.state, "torch": torch.get_rng_state(),
                                "order": order, "pos": pos, "losses": losses}, tmp)
    seconds = time.perf_counter() - t0
    model.eval()
    val_loss = None
    if len(val):
        with torch.no_grad():
            vb = torch.from_numpy(val)
            val_loss = float(np.mean([float(model(input_ids=vb[i:i + bs], labels=vb[i:i + bs]).loss)
                                      for i in range(0, len(vb), bs)]))
    k = max(1, steps // 20)
    return {"steps": steps, "blocks": int(len(train)), "val_blocks": int(n_val),
            "tokens_seen": steps * bs * block, "train_seconds": round(seconds, 2),
            "first_loss": losses[0] if losses else None,
            "final_loss": float(np.mean(losses[-k:])) if losses else None,
            "val_loss": val_loss, "loss_curve": [round(x, 4) for x in losses[::k]],
            "precision": precision, "hardware": hardware.describe(),
            "cpu_matmul": cpu_matmul.active(),
            "resumed_from_step": start or None}


