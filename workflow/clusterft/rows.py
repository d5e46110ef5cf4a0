"""Row operations shared by every feature kind (gradient, embedding, tfidf, loss trajectory):
the scalar pool score the selection's ``within: score`` rule and the report read."""

from __future__ import annotations

import numpy as np


def pool_scores(features: np.ndarray) -> np.ndarray:
    """Mean cosine similarity of each unit row with every OTHER row ([N] float32):
    ``(f_i . sum_j f_j - 1) / (N - 1)``, LESS's influence estimate with the pool itself as
    the target set (high: typical examples; low or negative: atypical or conflicting ones)."""
    n = len(features)
    if n < 2:
        return np.zeros(n, dtype=np.float32)
    f = np.asarray(features, dtype=np.float64)
    return ((f @ f.sum(0) - 1.0) / (n - 1)).astype(np.float32)
