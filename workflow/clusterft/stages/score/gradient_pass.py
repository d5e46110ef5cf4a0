"""The gradient pass of a score job: the projected per-example gradients of a run of
consecutive batches of the length-sorted pool (a shard; the one-job run is the shard that
holds every batch) at every warm-up checkpoint, resumable, plus the loss trajectories of
those rows and, where asked, the validation targets' gradients.

Why shards are runs of *batches*: a shard's batches are exactly the batches one job would
form, so every number is computed from the same operands in the same order, and merged
shards are the one-job output bit for bit (a slice of the pool in pool order would batch
examples differently, and a batched matmul's rounding depends on its batch).
:func:`shard_bounds` cuts the batches so that each shard gets about the same number of
padded tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from clusterft.stages.score.gradients import project_batch, set_lora
from clusterft.stages.score.merge import refuse_rows
from clusterft.stages.score.model import Scoring
from clusterft.stages.score.resume import Checkpoints
from clusterft.stages.score.warmup import loss_steps, loss_trajectories


def shard_bounds(lengths: Sequence[int], batch_size: int, shards: int) -> list[tuple[int, int]]:
    """Each shard's rows ``[lo, hi)`` of the length-sorted pool (``np.argsort(lengths,
    kind="stable")``): consecutive, covering every row once, cut only between the gradient
    pass's batches (multiples of ``batch_size``), each shard with about ``1/shards`` of
    the padded tokens (batch size times its longest example). More shards than batches
    leaves some empty."""
    n, bs, shards = len(lengths), int(batch_size), int(shards)
    if shards < 1 or bs < 1:
        raise ValueError(f"need shards >= 1 and batch_size >= 1, got {shards}, {bs}")
    srt = np.sort(np.asarray(lengths, dtype=np.int64), kind="stable")
    starts = np.arange(0, n, bs)
    ends = np.minimum(starts + bs, n)
    cost = np.cumsum((ends - starts) * (srt[ends - 1] if n else 0))
    total = float(cost[-1]) if n else 0.0
    cuts = [0]  # batches before each shard
    for i in range(1, shards):
        c = int(np.searchsorted(cost, total * i / shards))  # cost[c] >= target
        if c < len(cost):  # take c + 1 batches or c, whichever ends nearer the target
            below = float(cost[c - 1]) if c > 0 else 0.0
            c = c + 1 if float(cost[c]) - total * i / shards < total * i / shards - below else c
        cuts.append(min(max(c, cuts[-1]), len(starts)))
    cuts.append(len(starts))
    rows = [int(x) for x in starts] + [n]
    return [(rows[a], rows[b]) for a, b in zip(cuts[:-1], cuts[1:])]


def empty_arrays(n_checkpoints: int, n: int, dim: int, points: int) -> dict:
    """A shard's arrays before its pass: projected gradients [checkpoint, row, dim], their
    norms [checkpoint, row] and the loss trajectories [row, loss point] (NaN)."""
    return {"projected": np.zeros((n_checkpoints, n, dim), dtype=np.float32),
            "norms": np.zeros((n_checkpoints, n), dtype=np.float32),
            "trajectories": np.full((n, points), np.nan, dtype=np.float32)}


def gradient_pass(scoring: Scoring, cfg: dict, w: dict, encoded: Sequence[dict],
                  rows: np.ndarray, records: Sequence[dict], pad_id: int,
                  enc_targets: Sequence[dict] | None = None, ckpt: Checkpoints | None = None,
                  what: str = "score gradients") -> tuple[dict, dict | None]:
    """The arrays of one shard (:func:`empty_arrays`): the loss trajectories of its rows
    (the warm-up ``w``'s snapshots), their projected gradients and norms at every
    checkpoint and, with ``enc_targets``, the targets' (``target_projected``,
    ``target_norms``: after the pool's rows, which cannot depend on them).

    ``encoded``: the shard's examples in length-sorted order, starting at a batch boundary
    of the pool's pass; ``rows``: their pool indices (naming refused examples of
    ``records``). ``ckpt``: progress kept in ``gradients.pt`` every ``checkpoint_every``
    batches and between checkpoints; a rerun resumes there. Returns (arrays, where the
    pass resumed or None)."""
    checkpoints = w["checkpoints"]
    at = loss_steps(int(w["info"]["warmup_steps"]), int(cfg["loss_points"]))
    arrays = empty_arrays(len(checkpoints), len(rows), int(cfg["dim"]), len(at))
    k0, start, resumed = 0, 0, None
    done = ckpt.load("gradients.pt") if ckpt is not None else None
    if done is not None and not all(key in done for key in arrays):
        done = None  # progress of an older one-job run (no trajectories): start over
    if done is not None:
        k0, start = done["checkpoint"], done["next"]
        arrays = {key: done[key] for key in arrays}
        resumed = {"checkpoint": k0, "row": start}
    scoring.model.eval()
    if len(rows) and done is None:
        arrays["trajectories"] = loss_trajectories(scoring.model, w, encoded, cfg, pad_id)
    _batches(scoring, cfg, checkpoints, encoded, rows, records, pad_id, arrays, (k0, start),
             ckpt, what)
    if enc_targets is not None:
        arrays["target_projected"], arrays["target_norms"] = target_pass(
            scoring, enc_targets, checkpoints, cfg, pad_id)
    return arrays, resumed


def _batches(scoring: Scoring, cfg: dict, checkpoints: Sequence[dict],
             encoded: Sequence[dict], rows: np.ndarray, records: Sequence[dict], pad_id: int,
             arrays: dict, begin: tuple[int, int], ckpt: Checkpoints | None,
             what: str) -> None:
    """The resumable loop of :func:`gradient_pass` from ``begin`` (checkpoint, row), filling
    ``arrays`` in place; saves the progress after every ``checkpoint_every`` batches and at
    the end of every checkpoint's pass but the last."""
    from clusterft.pipeline.pace import Pace

    bs, n, n_ckpt = int(cfg["batch_size"]), len(rows), len(checkpoints)
    k0, start = begin
    every = int(cfg["checkpoint_every"]) * bs if ckpt is not None else 0
    left = (n_ckpt - k0) * -(-n // bs) - start // bs
    # Batches go shortest first, so the expected finish of the first pace lines is early.
    with Pace(left, what, unit="batch", units="batches", disable=left <= 1) as pace:
        for k in range(k0, n_ckpt if n else 0):
            set_lora(scoring.model, checkpoints[k]["lora"])
            moments = (tuple(checkpoints[k][key].to(scoring.device)
                             for key in ("exp_avg", "exp_avg_sq"))
                       if cfg["gradient_type"] == "adam" else None)
            for b in range(start if k == k0 else 0, n, bs):
                _batch(scoring, cfg, encoded, rows, records, pad_id, arrays, k, b, moments)
                pace.update()
                nxt = (k, b + bs) if b + bs < n else (k + 1, 0)
                if ckpt is not None and nxt[0] < n_ckpt and (
                        (every and (b + bs) % every == 0) or b + bs >= n):
                    ckpt.save("gradients.pt", {"checkpoint": nxt[0], "next": nxt[1], **arrays})


def _batch(scoring: Scoring, cfg: dict, encoded: Sequence[dict], rows: np.ndarray,
           records: Sequence[dict], pad_id: int, arrays: dict, k: int, b: int,
           moments) -> None:
    """Checkpoint ``k``'s rows of the batch at ``b`` into ``arrays`` (non-finite refused)."""
    from clusterft.modeling.tokenize import collate

    bs = int(cfg["batch_size"])
    batch = {key: v.to(scoring.device) for key, v in collate(encoded[b:b + bs], pad_id).items()}
    r, nrm = project_batch(scoring.model, batch, cfg, scoring.proj, moments)
    arrays["norms"][k, b:b + bs] = nrm.cpu().numpy()
    arrays["projected"][k, b:b + bs] = r.cpu().numpy()
    bad = np.flatnonzero(~np.isfinite(arrays["projected"][k, b:b + bs]).all(1))
    refuse_rows(rows[b + bad], "non-finite gradients",
                "the warm-up diverged or the model overflows", records, cfg)


def target_pass(scoring: Scoring, encoded: Sequence[dict], checkpoints: Sequence[dict],
                cfg: dict, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Projected plain (SGD) gradients of the target examples at every checkpoint:
    ([checkpoint, example, dim], [checkpoint, example] norms), length-sorted batches. LESS
    keeps the plain gradient for targets even with ``gradient_type: adam``: the Adam
    direction is a training example's update; a validation example only says which way its
    loss falls."""
    from clusterft.modeling.tokenize import collate

    n, bs = len(encoded), int(cfg["batch_size"])
    order = np.argsort([e["length"] for e in encoded], kind="stable")
    projected = np.zeros((len(checkpoints), n, int(cfg["dim"])), dtype=np.float32)
    norms = np.zeros((len(checkpoints), n), dtype=np.float32)
    for k, c in enumerate(checkpoints):
        set_lora(scoring.model, c["lora"])
        for lo in range(0, n, bs):
            idx = order[lo:lo + bs]
            batch = {key: v.to(scoring.device) for key, v in
                     collate([encoded[i] for i in idx], pad_id).items()}
            rows, nrm = project_batch(scoring.model, batch, cfg, scoring.proj)
            norms[k, idx] = nrm.cpu().numpy()
            projected[k, idx] = rows.cpu().numpy()
    return projected, norms
