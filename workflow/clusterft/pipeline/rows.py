"""Row files shared by every feature kind (gradient, embedding, tfidf, loss trajectory): an
[N, d] array in pool order beside the score run's scores.parquet (its ids), and the scalar
pool score the selection's ``within: score`` rule reads."""

from __future__ import annotations

import os

import numpy as np

from clusterft.pipeline.errors import InputError


def load_rows(array: str | os.PathLike, scores: str | os.PathLike, what: str = "features"):
    """(rows [N, d], scores table with ``id``) of one score run, checked: both exist, the
    array is 2-D and finite, the table has ids and one per row."""
    import pandas as pd

    for p in (array, scores):
        if not os.path.exists(p):
            raise InputError("file does not exist", path=str(p))
    try:
        x = np.load(array)
    except ValueError as e:
        raise InputError(f"not a .npy array ({e})", path=str(array)) from e
    if x.ndim != 2:
        raise InputError(f"{what} must be a 2-D array [examples, dim], got shape {x.shape}",
                         path=str(array))
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad):
        raise InputError(f"{len(bad)} rows hold NaN or infinite values (rows "
                         f"{bad[:5].tolist()}): the score run that wrote them diverged; rerun "
                         "score (lower score.warmup_lr)", path=str(array))
    df = pd.read_parquet(scores)
    if "id" not in df.columns:
        raise InputError("no 'id' column", path=str(scores), field="id")
    if len(df) != len(x):
        raise InputError(f"{len(df)} rows but {os.path.basename(array)} has {len(x)}; they must "
                         "come from the same score run", path=str(scores))
    return x, df


def pool_scores(features: np.ndarray) -> np.ndarray:
    """Mean cosine similarity of each unit row with every OTHER row ([N] float32):
    ``(f_i . sum_j f_j - 1) / (N - 1)``, LESS's influence estimate with the pool itself as
    the target set (high: typical examples; low or negative: atypical or conflicting ones)."""
    n = len(features)
    if n < 2:
        return np.zeros(n, dtype=np.float32)
    f = np.asarray(features, dtype=np.float64)
    return ((f @ f.sum(0) - 1.0) / (n - 1)).astype(np.float32)
