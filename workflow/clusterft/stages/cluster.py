"""Cosine (spherical) k-means of the gradient features.

Examples whose gradients point the same way have a similar training effect; clustering
them by cosine similarity gives the groups the selection balances. Spherical k-means:
unit-norm centroids, assignment by the highest cosine, k-means++ seeding (sampling
proportional to ``1 - cos``, i.e. to squared Euclidean distance on the sphere), ``n_init``
seeded restarts, keeping the restart with the highest total cosine to the centroids.
Empty clusters are refilled with the point farthest from its centroid. Cluster ids are
numbered by decreasing size (ties: the cluster holding the earlier pool row first), so
outputs do not depend on restart order.

Two backends (``cluster.backend``): ``numpy`` is the reference implementation above
(float64, exact k-means++); ``faiss`` runs ``faiss.Kmeans(spherical=True)`` (float32 BLAS,
faiss's own k-means++ seeding, ``nredo = n_init``, ``niter = max_iter``, every point used:
faiss's subsampling is off), then assigns, refills empty clusters, recomputes the
centroids and numbers the clusters exactly as the reference does, so the files have the
same format and id-order rules. On well-separated data both give the same labels; in
general they are different local optima of the same objective (the seeding draws differ).
The faiss backend runs on one thread (set inside the call and restored after), so its
result depends on the seed only. benchmarks/bench_cluster.py times the two.

``run_cluster`` is the stage's file I/O edge: features.npy + scores.parquet (ids) in,
clusters.parquet (id, cluster, centroid_sim) + centroids.npy out.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from clusterft.pipeline import provenance
from clusterft.pipeline.sections import merge_section
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.rows import load_rows

log = logging.getLogger(__name__)

DEFAULTS: dict = {
    # Number of clusters (must be <= the pool size).
    "k": 16,
    # Seeded k-means++ restarts; the one with the highest total cosine to its centroids wins.
    "n_init": 10,
    # Maximum assignment/update rounds per restart (stops earlier when no label changes).
    "max_iter": 100,
    # numpy (the reference implementation) or faiss (faiss.Kmeans(spherical=True), one thread,
    # same seeding rule, refill and numbering; for large pools: see benchmarks/README.md).
    "backend": "numpy",
    # Subtract the mean feature row (over the pool) before the cosine k-means, so the
    # direction every example's gradient shares does not dominate the cosines; the clusters'
    # centroids and centroid_sim are then those of the centred rows. false: the rows as the
    # score stage wrote them (docs/method_choices.md).
    "center": False,
}

BACKENDS = ("numpy", "faiss")


def merge_cfg(cfg: dict | None) -> dict:
    """Return ``cfg`` merged over DEFAULTS; unknown keys and bad values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "cluster")
    for key in ("k", "n_init", "max_iter"):
        if int(out[key]) < 1:
            raise InputError(f"must be >= 1, got {out[key]}", field=f"cluster.{key}")
    _check_backend(out["backend"])
    if not isinstance(out["center"], bool):
        raise InputError(f"must be true or false, got {out['center']!r}", field="cluster.center")
    return out


def center_rows(features: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """``features`` minus their mean row, float64 (the mean summed in float64 row blocks)."""
    x = np.asarray(features)
    if x.ndim != 2 or len(x) == 0:
        raise InputError(f"features must be a non-empty [N, dim] array, got shape {x.shape}",
                         field="features")
    mean = sum(np.asarray(x[i:i + chunk], dtype=np.float64).sum(0)
               for i in range(0, len(x), chunk)) / len(x)
    return np.asarray(x, dtype=np.float64) - mean


def _check_backend(backend: str):
    """The faiss module for backend 'faiss', None for 'numpy'; anything else raises InputError."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}",
                         field="cluster.backend")
    if backend == "faiss":
        try:
            import faiss
        except ImportError as e:
            raise InputError(f"backend 'faiss' needs the faiss-cpu package, which does not "
                             f"import here ({e}); pip install faiss-cpu (pinned in "
                             "requirements/constraints.txt) or use backend: numpy",
                             field="cluster.backend") from e
        return faiss
    return None


def _unit_rows(features: np.ndarray, dtype=np.float64) -> np.ndarray:
    """L2-normalised rows as ``dtype`` (norms always taken in float64)."""
    x = np.asarray(features)
    if x.ndim != 2 or len(x) == 0:
        raise InputError(f"features must be a non-empty [N, dim] array, got shape {x.shape}",
                         field="features")
    x = np.array(x, dtype=dtype, order="C")  # a copy: normalised in place below
    if not np.all(np.isfinite(x)):
        raise InputError("features contain NaN or inf", field="features")
    if x.dtype == np.float64:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
    else:
        norms = np.concatenate([np.linalg.norm(x[i:i + 65536].astype(np.float64), axis=1)
                                for i in range(0, len(x), 65536)])[:, None]
    if np.any(norms == 0):
        raise InputError(f"feature rows {np.flatnonzero(norms[:, 0] == 0)[:5].tolist()} are all "
                         "zero (no direction)", field="features")
    x /= norms.astype(x.dtype)
    return x


def _distinct_rows(x: np.ndarray, at_least: int, chunk: int = 4096) -> int:
    """Number of distinct rows (rounded to 6 decimals, as float64), counting only until
    ``at_least`` are found: exact when it returns fewer, and O(k) rows on typical data
    instead of a sort of the whole pool."""
    seen: set[bytes] = set()
    for start in range(0, len(x), chunk):
        block = np.round(np.asarray(x[start:start + chunk], dtype=np.float64), 6) + 0.0  # -0 -> 0
        for row in block:
            seen.add(row.tobytes())
            if len(seen) >= at_least:
                return len(seen)
    return len(seen)


def _kmeanspp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on the sphere: next centre drawn with probability ~ 1 - max cos."""
    n = len(x)
    idx = [int(rng.integers(n))]
    best = x @ x[idx[0]]
    for _ in range(1, k):
        dist = np.clip(1.0 - best, 0.0, None)
        dist[idx] = 0.0
        total = dist.sum()
        if total <= 0:  # only duplicates left: any unchosen row
            free = np.setdiff1d(np.arange(n), idx)
            nxt = int(rng.choice(free))
        else:
            nxt = int(rng.choice(n, p=dist / total))
        idx.append(nxt)
        best = np.maximum(best, x @ x[nxt])
    return x[idx].copy()


def _normalize_centroids(sums: np.ndarray, x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    # A cluster whose members cancel out exactly: fall back to its first member's direction.
    for c in np.flatnonzero(norms[:, 0] == 0):
        members = np.flatnonzero(labels == c)
        if len(members):
            sums[c], norms[c] = x[members[0]], 1.0
    return sums / np.where(norms == 0, 1.0, norms)


def _one_run(x: np.ndarray, k: int, max_iter: int, rng: np.random.Generator):
    centroids = _kmeanspp(x, k, rng)
    labels = None
    for _ in range(max_iter):
        sims = x @ centroids.T
        new = sims.argmax(1)
        # Refill empty clusters with the rows least similar to their own centroid.
        counts = np.bincount(new, minlength=k)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            own = sims[np.arange(len(x)), new]
            for c, row in zip(empty, _farthest_movable(own, new, counts, len(empty))):
                counts[new[row]] -= 1
                new[row] = c
                counts[c] += 1
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, x)
        centroids = _normalize_centroids(sums, x, labels)
    own = (x * centroids[labels]).sum(1)
    return labels, centroids, float(own.sum())


def _farthest_movable(own: np.ndarray, labels: np.ndarray, counts: np.ndarray, m: int) -> list[int]:
    """Up to m rows, least similar first, whose clusters keep at least one member."""
    counts = counts.copy()
    out: list[int] = []
    for row in np.argsort(own, kind="stable"):
        if counts[labels[row]] > 1:
            counts[labels[row]] -= 1
            out.append(int(row))
            if len(out) == m:
                break
    return out


def _canonical(labels: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber clusters by decreasing size, ties by first row."""
    k = len(centroids)
    sizes = np.bincount(labels, minlength=k)
    first = np.full(k, len(labels))
    np.minimum.at(first, labels, np.arange(len(labels)))
    order = np.lexsort((first, -sizes))  # new id i <- old id order[i]
    remap = np.empty(k, dtype=np.int64)
    remap[order] = np.arange(k)
    return remap[labels], centroids[order]


def _check_k(x: np.ndarray, k: int) -> int:
    n, k = len(x), int(k)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}", field="cluster.k")
    if k > n:
        raise InputError(f"k = {k} clusters asked for only {n} examples; lower cluster.k",
                         field="cluster.k")
    n_distinct = _distinct_rows(x, k)
    if k > n_distinct:
        raise InputError(f"k = {k} clusters asked for only {n_distinct} distinct feature rows; "
                         "lower cluster.k", field="cluster.k")
    return k


def cosine_kmeans(features: np.ndarray, k: int, seed: int = 0, n_init: int = 10,
                  max_iter: int = 100, backend: str = "numpy") -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means: (labels [N] int64 in 0..k-1, unit centroids [k, dim] float32).

    Rows of ``features`` are L2-normalised first. Deterministic in ``seed`` (for either
    ``backend``, see the module docstring). Raises InputError if ``k`` exceeds the number
    of (distinct) rows, or for an unknown or unavailable backend.
    """
    faiss = _check_backend(backend)
    if faiss is not None:
        return _faiss_kmeans(faiss, features, k, seed, int(n_init), int(max_iter))
    x = _unit_rows(features)
    k = _check_k(x, k)
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(int(n_init)):
        labels, centroids, obj = _one_run(x, k, int(max_iter), rng)
        if best is None or obj > best[2] + 1e-12:
            best = (labels, centroids, obj)
    labels, centroids = _canonical(best[0], best[1])
    return labels.astype(np.int64), centroids.astype(np.float32)


def _faiss_kmeans(faiss, features: np.ndarray, k: int, seed: int, n_init: int,
                  max_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """cosine_kmeans with faiss.Kmeans(spherical=True) on one thread, then the reference's
    final assignment, empty-cluster refill, centroid update and canonical numbering."""
    x = _unit_rows(features, np.float32)
    k = _check_k(x, k)
    n, dim = x.shape
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # float sums in a fixed order: the result depends on seed only
    try:
        km = faiss.Kmeans(dim, k, niter=max_iter, nredo=n_init, spherical=True,
                          seed=int(seed) % 2**31, verbose=False,
                          init_method=faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS,
                          min_points_per_centroid=1,  # no "too few points" warning
                          max_points_per_centroid=n // k + 1)  # no subsampling: every row counts
        km.train(x)
        index = faiss.IndexFlatIP(dim)
        index.add(np.ascontiguousarray(km.centroids, dtype=np.float32))
        sims, nearest = index.search(x, 1)
    finally:
        faiss.omp_set_num_threads(threads)
    labels, own = nearest[:, 0].astype(np.int64), sims[:, 0].astype(np.float64)
    counts = np.bincount(labels, minlength=k)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        for c, row in zip(empty, _farthest_movable(own, labels, counts, len(empty))):
            counts[labels[row]] -= 1
            labels[row] = c
            counts[c] += 1
    centroids = _normalize_centroids(_member_sums(x, labels, k), x, labels)
    labels, centroids = _canonical(labels, centroids)
    return labels, centroids.astype(np.float32)


def _member_sums(x: np.ndarray, labels: np.ndarray, k: int, chunk: int = 65536) -> np.ndarray:
    """[k, dim] float64 sums of the rows of each cluster, in row blocks (bounded memory)."""
    from scipy import sparse

    sums = np.zeros((k, x.shape[1]))
    for start in range(0, len(x), chunk):
        lab = labels[start:start + chunk]
        onehot = sparse.csr_matrix((np.ones(len(lab)), (lab, np.arange(len(lab)))),
                                   shape=(k, len(lab)))
        sums += onehot @ np.asarray(x[start:start + chunk], dtype=np.float64)
    return sums


def _centroid_sims(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray,
                   chunk: int = 65536) -> np.ndarray:
    """Cosine of each row with its centroid, float64, in row blocks (bounded memory)."""
    c = centroids.astype(np.float64)
    out = np.empty(len(x))
    for start in range(0, len(x), chunk):
        unit = _unit_rows(x[start:start + chunk])
        out[start:start + chunk] = (unit * c[labels[start:start + chunk]]).sum(1)
    return out


def run_cluster(features: str | os.PathLike, scores: str | os.PathLike, cfg: dict | None,
                out_clusters: str | os.PathLike, out_centroids: str | os.PathLike,
                seed: int = 0) -> dict:
    """Stage `cluster`: cosine k-means (cfg: k, n_init, max_iter, backend, center) of
    features.npy (with ``center``, of its rows minus their mean row).

    Ids come from scores.parquet (same row order). Writes clusters.parquet with ``id``,
    ``cluster`` and ``centroid_sim`` (cosine of the row with its centroid, used by
    ``select`` with ``within: centroid``) and centroids.npy [k, dim] float32. Returns
    a summary (k, sizes, mean centroid_sim).
    """
    import pandas as pd

    from clusterft.pipeline.io import save_npy, write_parquet

    cfg = merge_cfg(cfg)
    for p in (features, scores):
        if not os.path.exists(p):
            raise InputError("file does not exist", path=str(p))
    checked = provenance.check_inputs({"features": features, "scores": scores}, "cluster")
    x, df = load_rows(features, scores)
    if cfg["center"]:
        x = center_rows(x)
    try:
        labels, centroids = cosine_kmeans(x, int(cfg["k"]), seed, int(cfg["n_init"]),
                                          int(cfg["max_iter"]), backend=cfg["backend"])
    except InputError as e:
        raise InputError(str(e), path=str(features)) from e
    sim = _centroid_sims(x, labels, centroids)
    write_parquet(out_clusters, pd.DataFrame({"id": df["id"].astype(str).to_numpy(),
                                              "cluster": labels, "centroid_sim": sim}))
    save_npy(out_centroids, centroids)
    provenance.write({"clusters": out_clusters, "centroids": out_centroids}, "cluster", checked,
                     inherit=("features", "scores"), run_key="clusters", config=cfg, seed=seed)
    sizes = np.bincount(labels, minlength=len(centroids)).tolist()
    log.info("k=%d cluster sizes %s", len(centroids), sizes)
    return {"k": len(centroids), "sizes": sizes, "mean_centroid_sim": float(sim.mean())}
