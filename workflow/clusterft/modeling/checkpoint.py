"""Resumable training checkpoints: one file, replaced atomically, that a rerun of the same
run (same config, ranks, seed and data) resumes from and any other run ignores."""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from pathlib import Path

import numpy as np

from clusterft.modeling.distributed import Dist, barrier, gather_object
from clusterft.pipeline.io import atomic_path

# Keys that change neither the model nor the data order: a run may resume across them
# (gradient checkpointing recomputes the same activations: equal gradients, tested in
# tests/test_train_scale.py; gpus_per_node only places the same ranks on other nodes;
# max_length_quantile and max_length_cap act through max_length, fingerprinted as resolved).
RESUMABLE_ACROSS = ("checkpoint_every", "max_steps", "num_threads", "log_every",
                    "gradient_checkpointing", "gpus_per_node", "max_length_quantile",
                    "max_length_cap")


def fingerprint(cfg: dict, world_size: int, distribution: str, seed: int, ids: list[str]) -> str:
    """What a checkpoint must match to be resumed: config, ranks, distribution, seed, data."""
    keep = {k: v for k, v in cfg.items() if k not in RESUMABLE_ACROSS}
    blob = json.dumps({"cfg": keep, "world": world_size, "dist": distribution, "seed": seed,
                       "ids": hashlib.sha1("\n".join(ids).encode()).hexdigest()},
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


def rng_state() -> dict:
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    import torch

    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(ckpt_dir: Path, model, opt, sched, state: dict, d: Dist) -> None:
    """Save model/optimizer/scheduler/progress/metrics + every rank's RNG (rank 0 writes)."""
    import torch

    rngs = gather_object(d, rng_state())
    if d.rank == 0:
        blob = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": rngs, **state}
        # One file replaced atomically (not the folder: replacing a folder removes the old
        # one first, and a kill in between would leave no checkpoint at all).
        with atomic_path(Path(ckpt_dir) / "state.pt") as tmp:
            torch.save(blob, tmp)
    barrier(d)


def load(ckpt_dir: Path, fp: str, d: Dist) -> dict | None:
    """The checkpoint that matches fingerprint ``fp``, or None (a mismatched one warns)."""
    import torch

    f = Path(ckpt_dir) / "state.pt"
    if not f.exists():
        return None
    blob = torch.load(f, map_location="cpu", weights_only=False)
    if blob.get("fingerprint") != fp:
        if d.rank == 0:
            warnings.warn(f"{ckpt_dir}: checkpoint is from a different run (config, ranks, seed "
                          "or data differ); starting from scratch", stacklevel=2)
        return None
    return blob


def restore(blob: dict, model, opt, sched, d: Dist) -> None:
    """Load a checkpoint's weights, optimiser, schedule and this rank's RNG streams."""
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"][d.rank])
