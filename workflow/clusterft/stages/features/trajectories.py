"""Loss-trajectory features for S2L (Yang et al. 2024, "SmallToLarge").

S2L clusters examples by how a small proxy model's loss on them moves during training. Here
the proxy run is the scoring warm-up (one warm-up serves gradient features and trajectories),
and ``score`` records each example's loss at ``score.loss_points`` evenly spaced warm-up
steps (``trajectories.npy`` [N, P]). A feature row is the example's trajectory minus the
pool's mean trajectory, L2-normalised: the same cosine k-means as every other feature kind
then groups examples whose losses sit above or below the pool's in the same way over
training. S2L itself runs Euclidean k-means on the raw trajectories; centring keeps the
geometry of the deviations, normalising drops their size (documented deviation, so that one
clustering code serves every feature kind).

``run_loss_features`` is the stage's file I/O edge: trajectories.npy + the score run's
scores.parquet (ids) in, features.npy + scores.parquet out, in score's format.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.rows import load_rows, pool_scores

log = logging.getLogger(__name__)


def loss_trajectory_features(trajectories: np.ndarray, ids=None) -> np.ndarray:
    """Centred (pool mean per measurement subtracted), L2-normalised rows, float32."""
    t = np.asarray(trajectories, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] < 2 or t.shape[1] < 1:
        raise InputError(f"trajectories must be [N >= 2, points >= 1], got shape {t.shape}",
                         field="trajectories")
    bad = np.flatnonzero(~np.isfinite(t).all(axis=1))
    if len(bad):
        raise InputError(f"{len(bad)} trajectories hold NaN or inf (rows {bad[:5].tolist()}): "
                         "the warm-up diverged; rerun score (lower score.warmup_lr)",
                         field="trajectories")
    c = t - t.mean(axis=0, keepdims=True)
    norms = np.linalg.norm(c, axis=1, keepdims=True)
    flat = np.flatnonzero(norms[:, 0] <= 1e-12 * max(1.0, float(np.abs(t).max())))
    if len(flat):
        names = [ids[i] for i in flat[:5]] if ids is not None else flat[:5].tolist()
        raise InputError(f"{len(flat)} examples have exactly the pool's mean trajectory (ids "
                         f"{names}): no direction to cluster; with one loss point (or none "
                         "that differ) use score.loss_points >= 2 and a warm-up",
                         field="trajectories")
    return (c / norms).astype(np.float32)


def run_loss_features(trajectories: str | os.PathLike, scores: str | os.PathLike,
                      out_features: str | os.PathLike, out_scores: str | os.PathLike) -> dict:
    """Stage `loss_features`: trajectories of one score run -> features.npy + scores.parquet
    (id, score = pool_scores of the rows, grad_norm NaN), with provenance."""
    import pandas as pd

    from clusterft.pipeline.io import save_npy, write_parquet

    for p in (trajectories, scores):
        if not os.path.exists(p):
            raise InputError("file does not exist", path=str(p))
    checked = provenance.check_inputs({"trajectories": trajectories, "scores": scores},
                                      "loss_features")
    t, df = load_rows(trajectories, scores, "trajectories")
    ids = df["id"].astype(str).to_numpy()
    try:
        f = loss_trajectory_features(t, ids)
    except InputError as e:
        raise InputError(e.message, path=str(trajectories), field=e.field) from e
    save_npy(out_features, f)
    write_parquet(out_scores, pd.DataFrame({"id": ids, "score": pool_scores(f).astype(np.float64),
                                            "grad_norm": np.full(len(ids), np.nan)}))
    provenance.write({"features": out_features, "scores": out_scores}, "loss_features", checked,
                     inherit=("trajectories", "scores"), run_key="score_run")
    log.info("loss-trajectory features: %d examples x %d points", *t.shape)
    return {"n": int(len(t)), "points": int(t.shape[1])}
