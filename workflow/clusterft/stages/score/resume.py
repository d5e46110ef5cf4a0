"""Resumable progress of a score job. A killed job (a preempted GPU, a wall-time limit)
keeps its warm-up and the gradient rows done so far in a folder beside its output and a
rerun goes on from there to the same bytes; the progress is used only by a run with the
same fingerprint (config less the keys it may resume across, seed, model, pool), so a
changed run starts over instead of mixing two runs' numbers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from clusterft.stages.score.settings import RESUMABLE_ACROSS

log = logging.getLogger(__name__)

class Checkpoints:
    """Resumable progress of one score run: ``warmup.pt`` (every warm-up checkpoint taken
    so far, LoRA weights and Adam moments, the losses measured so far and, while the
    warm-up is unfinished, what it needs to go on) and ``gradients.pt`` (the rows of every
    checkpoint done so far and where the pass stands), each replaced
    atomically and used only by a run with the same fingerprint (config, seed, model, pool)."""

    def __init__(self, folder: str | os.PathLike, fingerprint: str) -> None:
        self.dir, self.fp = Path(folder), fingerprint

    def load(self, name: str) -> dict | None:
        import warnings

        import torch

        f = self.dir / name
        if not f.exists():
            return None
        blob = torch.load(f, map_location="cpu", weights_only=False)
        if blob.get("fingerprint") != self.fp:
            warnings.warn(f"{f}: progress of a different score run (config, seed, model or pool "
                          "differ); starting over", stacklevel=2)
            return None
        log.info("resuming from %s", f)
        return blob

    def save(self, name: str, blob: dict) -> None:
        import torch

        from clusterft.pipeline.io import atomic_path

        with atomic_path(self.dir / name) as tmp:
            torch.save({"fingerprint": self.fp, **blob}, tmp)


def score_fingerprint(cfg: dict, seed: int, model_digest: str, pool_digest: str) -> str:
    """The fingerprint of a score run (its Checkpoints only resume the same run)."""
    keep = {k: v for k, v in cfg.items() if k not in RESUMABLE_ACROSS}
    return hashlib.sha1(json.dumps({"cfg": keep, "seed": seed, "model": model_digest,
                                    "pool": pool_digest}, sort_keys=True,
                                   default=str).encode()).hexdigest()

