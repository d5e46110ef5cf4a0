"""The merge of a score run: the shards' raw projected gradients (one job's: one shard)
into the stage's files. Normalising, combining the checkpoints and scoring happen only
here, on the whole pool, so one job and N shards write the same bytes.

Checkpoints are combined as LESS weighs them: checkpoint k's L2-normalised rows ``f_k``
are concatenated as ``sqrt(w_k) * f_k``, ``w_k`` its segment's mean learning rate over the
sum of them (:func:`combine_checkpoints`): rows stay unit-norm and the cosine of two rows is
LESS's lr-weighted sum of per-checkpoint cosines. The scalar score of an example is LESS's
influence with the pool itself as the target set (``clusterft.pipeline.rows.pool_scores``:
the mean cosine with every other pool example). ``grad_norm`` is the L2 norm of the
unprojected per-example vector (the raw gradient, or the Adam direction) at the last
checkpoint, which LESS normalises away because it is larger for short responses; with
``projection: kronecker`` it is the projected row's norm before normalisation (the
unprojected gradient is never formed), whose square estimates the gradient's squared norm
without bias. Rows whose gradient is zero or not finite have no direction and are refused,
naming the examples (:func:`refuse_rows`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.rows import pool_scores

SHARD_FORMAT = "clusterft-score-shard/1"
TARGET_SHARD = 0  # the shard that also computes the targets' features


def checkpoint_weights(checkpoints: Sequence[dict]) -> list[float]:
    """LESS's checkpoint weights: each segment's mean learning rate over their sum (equal
    weights if every mean is zero, as for a warm-up of zero steps)."""
    lrs = [float(c["lr_mean"]) for c in checkpoints]
    total = sum(lrs)
    if total <= 0:
        return [1.0 / len(lrs)] * len(lrs)
    return [lr / total for lr in lrs]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows raise: they have no direction)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        bad = np.flatnonzero(norms[:, 0] == 0)[:5].tolist()
        raise ValueError(f"zero gradient for rows {bad}: cannot normalise")
    return (x / norms).astype(np.float32)


def pool_features(projected, norms, checkpoints, records, cfg) -> tuple:
    """The pool's feature rows from its per-checkpoint projected gradients (one job's or the
    merged shards'): rows with a zero gradient refused, each checkpoint L2-normalised and
    combined with its learning-rate weight. Returns (features, scores, weights)."""
    refuse_rows(np.flatnonzero((norms == 0).any(0)), "zero gradient",
                "their loss no longer depends on the LoRA weights, as after a warm-up that "
                "diverged into a saturated model", records, cfg)
    weights = checkpoint_weights(checkpoints)
    features = combine_checkpoints([l2_normalize(p) for p in projected], weights)
    return features, pool_scores(features), weights


def target_features(t_proj, t_norms, weights, records, cfg) -> np.ndarray:
    """The validation targets' feature rows, combined like the pool's (non-finite or zero
    target gradients refused)."""
    refuse_rows(np.flatnonzero(~np.isfinite(t_proj).all(2).all(0)), "non-finite target "
                "gradients", "the warm-up diverged or the model overflows", records, cfg)
    refuse_rows(np.flatnonzero((t_norms == 0).any(0)), "zero target gradient",
                "their loss does not depend on the LoRA weights", records, cfg)
    return combine_checkpoints([l2_normalize(p) for p in t_proj], weights)


def combine_checkpoints(rows: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Features of several warm-up checkpoints: ``concat_k sqrt(w_k) * f_k`` (float32).

    With unit-norm per-checkpoint rows ``f_k`` and weights summing to 1 the rows stay
    unit-norm, and the dot product (cosine) of two rows is exactly
    ``sum_k w_k * cos_k``: LESS's influence, the learning-rate-weighted sum of the
    per-checkpoint cosine similarities (with normalised weights). Concatenating rather than
    summing the ``f_k`` keeps that identity (a sum would add cross-checkpoint terms
    ``f_k . f'_l``), so clustering and pool scores see LESS's similarity. One checkpoint:
    its rows unchanged.
    """
    if len(rows) == 1:
        return rows[0]
    return np.concatenate([np.float32(math.sqrt(w)) * f for w, f in zip(weights, rows)],
                          axis=1).astype(np.float32)


def refuse_rows(rows: np.ndarray, what: str, why: str, examples: Sequence[dict],
                cfg: dict) -> None:
    """DivergedError naming the examples whose gradient rows are unusable (none: return)."""
    if not len(rows):
        return
    from clusterft.modeling.optim import DivergedError

    ids = [examples[i].get("id", int(i)) for i in rows[:5]]
    raise DivergedError(f"{what} for {len(rows)} of {len(examples)} examples (ids {ids}): "
                        f"{why}; lower score.warmup_lr (now {cfg['warmup_lr']:g})",
                        field="score.warmup_lr")


def save_shard(path: str | os.PathLike, blob: dict) -> None:
    """A shard's arrays (``clusterft.stages.score.gradient_pass``) and what it is (format,
    shard, shards, bounds, rows, target ids and tasks) as one .npz (numpy, open format)."""
    from clusterft.pipeline.io import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to the name
            np.savez(f, **blob)


def load_shard(path: str | os.PathLike) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            blob = {k: z[k] for k in z.files}
    except Exception as e:
        raise InputError(f"not a readable score shard ({e})", path=str(path)) from e
    if str(blob.get("format")) != SHARD_FORMAT:
        raise InputError(f"not a score shard (format {blob.get('format')!s}, expected "
                         f"{SHARD_FORMAT})", path=str(path))
    return blob


def check_cover(blobs: Sequence[dict], paths: Sequence[Any],
                bounds: Sequence[tuple[int, int]], order: np.ndarray) -> None:
    """The shards are shards 0..len(bounds)-1 of the pool's pass, in order, each holding the
    rows ``order[lo:hi]`` of its ``bounds``, and cover the pool once (else InputError)."""
    shards = len(bounds)
    for i, (p, b) in enumerate(zip(paths, blobs)):
        if int(b["shard"]) != i or int(b["shards"]) != shards or \
                tuple(int(x) for x in b["bounds"]) != bounds[i] or \
                not np.array_equal(b["rows"], order[bounds[i][0]:bounds[i][1]]):
            raise InputError(f"expected shard {i} of {shards} (rows {bounds[i][0]}..."
                             f"{bounds[i][1]} of the length-sorted pool), got shard "
                             f"{int(b['shard'])} of {int(b['shards'])} (rows "
                             f"{b['bounds'].tolist()})", path=str(p), field="score.shards")
    rows = np.concatenate([b["rows"] for b in blobs])
    n = len(order)
    if len(rows) != n or not np.array_equal(np.sort(rows), np.arange(n)):
        raise InputError(f"the shards hold {len(rows)} rows, not each of the pool's {n} once",
                         path=str(paths[0]), field="score.shards")


def assemble(blobs: Sequence[dict], n: int, n_checkpoints: int,
             dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shards' arrays in pool order: (projected [checkpoint, n, dim], norms
    [checkpoint, n], trajectories [n, loss points])."""
    projected = np.zeros((n_checkpoints, n, dim), dtype=np.float32)
    norms = np.zeros((n_checkpoints, n), dtype=np.float32)
    trajectories = None
    for b in blobs:
        projected[:, b["rows"]] = b["projected"]
        norms[:, b["rows"]] = b["norms"]
        if trajectories is None:
            trajectories = np.full((n, b["trajectories"].shape[1]), np.nan, dtype=np.float32)
        trajectories[b["rows"]] = b["trajectories"]
    return projected, norms, trajectories


def write_score(outs: dict, records: Sequence[dict], features: np.ndarray, scores: np.ndarray,
                norms: np.ndarray, trajectories: np.ndarray, targets: tuple, checked: dict,
                cfg: dict, seed: int) -> dict:
    """The stage's files and their sidecars: ``outs`` maps features, scores and (optional)
    trajectories, targets, target_ids to paths; ``targets`` is (rows or None, records or
    None, tasks). Returns the outputs map."""
    import pandas as pd

    from clusterft.pipeline.io import save_npy, write_parquet
    from clusterft.tasks.targets import write_outputs

    save_npy(outs["features"], features)
    write_parquet(outs["scores"], pd.DataFrame({"id": [r["id"] for r in records],
                                                "score": scores.astype(np.float64),
                                                "grad_norm": norms.astype(np.float64)}))
    outputs = {"features": outs["features"], "scores": outs["scores"]}
    if outs.get("trajectories") is not None:
        save_npy(outs["trajectories"], trajectories)
        outputs["trajectories"] = outs["trajectories"]
    if outs.get("targets") is not None:
        outputs.update(write_outputs(outs["targets"], outs["target_ids"], *targets,
                                     features.shape[1]))
    provenance.write(outputs, "score", checked, inherit=("pool", "model", "items"),
                     run_key="score_run", config=cfg, seed=seed)
    return outputs
