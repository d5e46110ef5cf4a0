"""Budgeted data selection: everything, a uniform random subset, per-cluster quotas on
clusters of some features (the method and its feature baselines), S2L, or the oracle.

Methods (``select``):
- ``full``: every example (the budget is checked but not used).
- ``random``: a seeded uniform sample of ``n = round(budget * N)`` examples (at least 1).
- ``cluster``: the same ``n``, split into per-cluster quotas that sum to exactly ``n``:
  - ``quota: uniform`` (default): water-filling - every cluster gets an equal share,
    capped at its size, and what capped clusters cannot take is shared among the rest.
    The most balanced split; it is what "balance the skills" means.
  - ``quota: proportional``: shares proportional to cluster size (a stratified sample).
  - ``quota: sqrt``: shares proportional to sqrt(size), capped at size: in between.
  Fractional shares are rounded by largest remainder (ties: the larger, then the
  lower-numbered cluster). When ``n >= k`` every cluster gets at least one example, so
  no cluster (skill) is dropped; with ``n < k`` the n highest shares get one each.
  Within a cluster examples are picked by ``within``:
  - ``random`` (default): a seeded uniform sample (one RNG stream per cluster id). This
    keeps the cluster's internal diversity and makes ``cluster`` differ from ``random``
    only in the cross-cluster balance - the effect the method claims.
  - ``score``: highest ``score`` first (LESS-style: most aligned with the pool's
    gradients; favours typical examples, so near-duplicates and paraphrases crowd in).
  - ``centroid``: highest cosine with the cluster centroid first (most prototypical;
    same caveat); needs clusters.parquet's ``centroid_sim`` column.

- ``embed-cluster``, ``tfidf-cluster``: exactly ``cluster`` (same quotas, same within-
  cluster rule) on clusters of other features; the caller passes those clusters.
- ``oracle``: exactly ``cluster`` on the TRUE labels (labels.parquet) instead of clusters:
  what perfect skill recovery would buy under the same quotas. A reference, not a method.
- ``s2l``: S2L's own budget rule (Yang et al. 2024) on clusters of loss trajectories:
  clusters in increasing size, each takes ``min(size, remaining // clusters left)`` at
  random. Its shares are the uniform water-filling ones, rounded S2L's way (floors, the
  remainder going to the larger clusters), so it differs from ``cluster`` in its features
  and its rounding, not in its balance rule.

- ``less``: LESS's target-aware top-k (clusterft.tasks.targets.less_scores): each pool example's
  mean cosine with each benchmark task's validation examples in gradient-feature space,
  the max over tasks (``less_agg``), highest first.
- ``rds``: RDS+ (clusterft.tasks.targets.rds_round_robin): the same similarity on embedding
  features, the tasks taking turns in picking their best example.
- ``rs2``: RS2 (Okanovic et al. 2023): for each of ``epochs`` epochs a fresh seeded uniform
  subset of the same ``n``; selection.parquet gets an ``epoch`` column and train uses
  subset e in epoch e. Same steps as a fixed subset, more distinct examples seen.

``run_select`` is the stage's file I/O edge: clusters.parquet + scores.parquet in,
selection.parquet (id, cluster, score; pool order) + selection.json out.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np

from clusterft.pipeline import provenance
from clusterft.pipeline.sections import merge_section
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.names import FULL, LESS, METHODS, ORACLE, RANDOM, RDS, RS2, S2L, TARGET_AWARE

log = logging.getLogger(__name__)

DEFAULTS: dict = {
    # Per-cluster quota rule for method 'cluster': uniform (water-filling equal shares
    # capped at cluster size), proportional (to size) or sqrt (to sqrt(size), capped).
    "quota": "uniform",
    # How examples are picked inside a cluster: random (seeded), score (highest first) or
    # centroid (closest to the cluster centroid first).
    "within": "random",
    # LESS: a pool example's score over the tasks: max (LESS's choice) or mean.
    "less_agg": "max",
}

QUOTAS = ("uniform", "proportional", "sqrt")
WITHIN = ("random", "score", "centroid")


def merge_cfg(cfg: dict | None) -> dict:
    """Return ``cfg`` merged over DEFAULTS; unknown keys and values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "select")
    for key, valid in (("quota", QUOTAS), ("within", WITHIN), ("less_agg", ("max", "mean"))):
        if out[key] not in valid:
            raise InputError(f"unknown value '{out[key]}'; valid: {', '.join(valid)}",
                             field=f"select.{key}")
    return out


def n_select(n_pool: int, budget: float) -> int:
    """Examples a budget buys: round-half-up(budget * N), at least 1."""
    try:
        b = float(budget)
    except (TypeError, ValueError) as e:
        raise InputError(f"budget must be a number in (0, 1], got {budget!r}", field="budget") from e
    if not 0 < b <= 1:
        raise InputError(f"budget must be in (0, 1], got {budget}", field="budget")
    return max(1, min(n_pool, int(math.floor(b * n_pool + 0.5))))


def cluster_quotas(sizes, total: int, quota: str = "uniform") -> np.ndarray:
    """Integer quotas per cluster: sum == total, each <= its size, each >= 1 if total >= k.

    Real-valued shares are ``clip(lam * w_c, lo, size_c)`` with ``w_c`` = 1 (uniform),
    ``size_c`` (proportional) or ``sqrt(size_c)`` (sqrt), ``lo`` = 1 when every cluster
    can get one (else 0), and ``lam`` solved so the shares sum to ``total``; they are then
    rounded by largest remainder.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if quota not in QUOTAS:
        raise InputError(f"unknown quota '{quota}'; valid: {', '.join(QUOTAS)}", field="select.quota")
    if sizes.ndim != 1 or len(sizes) == 0 or np.any(sizes < 1):
        raise ValueError(f"cluster sizes must be positive, got {sizes.tolist()}")
    k, n = len(sizes), int(sizes.sum())
    if not 0 <= total <= n:
        raise ValueError(f"total {total} outside [0, {n}]")
    w = {"uniform": np.ones(k), "proportional": sizes.astype(float),
         "sqrt": np.sqrt(sizes.astype(float))}[quota]
    lo = np.full(k, 1.0 if total >= k else 0.0)
    cap = sizes.astype(float)

    def shares(lam: float) -> np.ndarray:
        return np.clip(lam * w, lo, cap)

    a, b = 0.0, float((cap / w).max())
    for _ in range(200):  # bisection: sum(shares) is continuous and non-decreasing in lam
        mid = 0.5 * (a + b)
        if shares(mid).sum() < total:
            a = mid
        else:
            b = mid
    q = shares(b)
    base = np.clip(np.floor(q + 1e-9), lo, cap).astype(np.int64)
    left = total - int(base.sum())
    frac = q - base
    order = np.lexsort((np.arange(k), -sizes, -np.round(frac, 9)))  # largest remainder first
    while left > 0:
        moved = False
        for c in order:
            if left == 0:
                break
            if base[c] < sizes[c]:
                base[c] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("quota rounding could not place the remainder")
    if left < 0 or np.any(base > sizes):
        raise RuntimeError(f"quota rounding failed: {base.tolist()} for total {total}")
    return base


def s2l_quotas(sizes, total: int) -> np.ndarray:
    """S2L's per-cluster budget: smallest cluster first, each ``min(size, left // clusters
    left)``; sums to ``total`` (<= sum of sizes) exactly, since the last, largest cluster
    takes what is left."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.ndim != 1 or len(sizes) == 0 or np.any(sizes < 1):
        raise ValueError(f"cluster sizes must be positive, got {sizes.tolist()}")
    if not 0 <= total <= int(sizes.sum()):
        raise ValueError(f"total {total} outside [0, {int(sizes.sum())}]")
    k = len(sizes)
    out = np.zeros(k, dtype=np.int64)
    left = int(total)
    for i, c in enumerate(np.lexsort((np.arange(k), sizes))):  # smallest first, then lower id
        out[c] = min(int(sizes[c]), left // (k - i))
        left -= int(out[c])
    assert left == 0, (sizes.tolist(), total)
    return out


def rs2_subsets(n_pool: int, n: int, epochs: int, seed: int = 0) -> list[np.ndarray]:
    """RS2's per-epoch subsets: ``epochs`` sorted index arrays of ``n`` rows each, drawn
    without replacement within an epoch and independently across epochs (RS2 without
    replacement across epochs is a variant; the paper's default draws afresh)."""
    if int(epochs) < 1:
        raise InputError(f"rs2 needs epochs >= 1, got {epochs}", field="epochs")
    return [np.sort(np.random.default_rng([seed, 2, e]).choice(n_pool, size=n, replace=False)
                    ).astype(np.int64) for e in range(int(epochs))]


def _rule(method: str, cfg: dict) -> tuple[str | None, str | None]:
    """(quota rule, within-cluster rule) of a method: none for full and random, S2L's own
    for s2l, the configured ones for cluster, its feature baselines and the oracle."""
    if method in (FULL, RANDOM, RS2, LESS, RDS):
        return None, None
    if method == S2L:
        return S2L, "random"
    return cfg["quota"], cfg["within"]


def _pick(members: np.ndarray, m: int, within: str, scores: np.ndarray | None,
          centroid_sim: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    if m >= len(members):
        return members
    if within == "random":
        return rng.choice(members, size=m, replace=False)
    key = scores if within == "score" else centroid_sim
    if key is None:
        raise InputError(f"within: {within} needs "
                         f"{'scores' if within == 'score' else 'the centroid_sim column'}",
                         field="select.within")
    order = np.argsort(-np.asarray(key, dtype=np.float64)[members], kind="stable")
    return members[order[:m]]


def select(ids, clusters, scores, method: str, budget: float, cfg: dict | None = None,
           seed: int = 0, centroid_sim=None, features=None, targets=None,
           target_task=None) -> np.ndarray:
    """Row indices (sorted, int64) of the selected examples.

    ``ids``, ``clusters`` (ints), ``scores`` and ``centroid_sim`` (optional) are aligned
    per pool row; ``features`` (pool rows), ``targets`` (validation rows) and
    ``target_task`` (their tasks) are read by less and rds only. See the module docstring
    for the methods and ``cfg`` keys.
    """
    cfg = merge_cfg(cfg)
    if method not in METHODS:
        raise InputError(f"unknown method '{method}'; valid: {', '.join(METHODS)}", field="method")
    ids = np.asarray(ids)
    clusters = np.asarray(clusters)
    n = len(ids)
    if n == 0:
        raise InputError("the pool is empty", field="id")
    for name, arr in (("cluster", clusters), ("score", scores), ("centroid_sim", centroid_sim)):
        if arr is not None and len(arr) != n:
            raise InputError(f"{len(arr)} values for {n} ids", field=name)
    if len(np.unique(ids)) != n:
        raise InputError("ids are not unique", field="id")
    m = n_select(n, budget)
    if method == FULL:
        return np.arange(n, dtype=np.int64)
    if method in TARGET_AWARE:
        from clusterft.tasks.targets import less_scores, rds_round_robin, top_k

        if features is None or targets is None or target_task is None or len(targets) == 0:
            raise InputError(f"method '{method}' needs the pool's features and the benchmark "
                             "tasks' validation features (none were written: set the "
                             "dataset's val_per_task > 0 with repo-defined tasks)",
                             field="targets")
        if len(features) != n:
            raise InputError(f"{len(features)} feature rows for {n} ids", field="features")
        if method == LESS:
            return top_k(less_scores(features, targets, target_task, cfg["less_agg"]), m)
        return rds_round_robin(features, targets, target_task, m)
    if method == RS2:  # its first epoch's subset (run_select writes every epoch's)
        return rs2_subsets(n, m, 1, seed)[0]
    if method == RANDOM:
        return np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False)).astype(np.int64)
    labels, inv, sizes = np.unique(clusters, return_inverse=True, return_counts=True)
    quota, within = _rule(method, cfg)
    quotas = s2l_quotas(sizes, m) if quota == S2L else cluster_quotas(sizes, m, quota)
    scores = None if scores is None else np.asarray(scores, dtype=np.float64)
    sim = None if centroid_sim is None else np.asarray(centroid_sim, dtype=np.float64)
    picked = []
    for j in range(len(labels)):
        members = np.flatnonzero(inv == j)
        rng = np.random.default_rng([seed, j])  # one stream per cluster
        picked.append(_pick(members, int(quotas[j]), within, scores, sim, rng))
    out = np.sort(np.concatenate(picked)).astype(np.int64)
    assert len(out) == m
    return out


def summarize(clusters, selected: np.ndarray, method: str, budget: float, seed: int,
              cfg: dict | None = None) -> dict:
    """The selection.json summary: sizes overall and per cluster."""
    cfg = merge_cfg(cfg)
    clusters = np.asarray(clusters)
    labels, counts = np.unique(clusters, return_counts=True)
    sel = np.unique(clusters[selected], return_counts=True)
    chosen = dict(zip(sel[0].tolist(), sel[1].tolist()))
    return {"method": method, "budget": float(budget), "seed": int(seed),
            **dict(zip(("quota", "within"), _rule(method, cfg))),
            "n_pool": int(len(clusters)), "n_selected": int(len(selected)),
            "n_clusters": int(len(labels)),
            "clusters": [{"cluster": int(c), "n_pool": int(k), "n_selected": int(chosen.get(c, 0))}
                         for c, k in zip(labels.tolist(), counts.tolist())]}


def oracle_clusters(ids: np.ndarray, labels: str | os.PathLike) -> np.ndarray:
    """Integer codes of the true labels of ``ids`` (labels.parquet: id, label), in the order
    of ``ids``; every id must have a label (a labels file of another pool is refused)."""
    import pandas as pd

    if not os.path.exists(labels):
        raise InputError("file does not exist (method 'oracle' reads the true labels)",
                         path=str(labels))
    df = pd.read_parquet(labels)
    for col in ("id", "label"):
        if col not in df.columns:
            raise InputError(f"no '{col}' column (has {list(df.columns)})", path=str(labels),
                             field=col)
    of = dict(zip(df["id"].astype(str), df["label"].astype(str)))
    missing = [i for i in ids if i not in of]
    if missing:
        raise InputError(f"{len(missing)} pool ids have no label (e.g. {missing[:3]}); the "
                         "labels must come from the prepare_data run of this pool",
                         path=str(labels), field="id")
    _, codes = np.unique([of[i] for i in ids], return_inverse=True)
    return codes.astype(np.int64)


def run_select(clusters: str | os.PathLike, scores: str | os.PathLike, method: str,
               budget: float, cfg: dict | None, out_selection: str | os.PathLike,
               out_summary: str | os.PathLike, seed: int = 0,
               labels: str | os.PathLike | None = None, epochs: int = 1,
               features: str | os.PathLike | None = None,
               targets: str | os.PathLike | None = None,
               target_ids: str | os.PathLike | None = None) -> dict:
    """Stage `select`: write selection.parquet (id, cluster, score; pool order) and
    selection.json (method, budget, seed, quota, within, n_pool, n_selected, per-cluster
    pool/selected counts). Returns the summary.

    ``clusters``: the clusters of the method's features (clusterft.pipeline.names.features_of).
    ``labels``: labels.parquet, read by method ``oracle`` only, whose "clusters" are the
    true labels (their codes, in sorted label order, go to the ``cluster`` column).
    ``epochs``: how many per-epoch subsets method ``rs2`` writes (the ``epoch`` column; a
    train run with more epochs cycles through them).
    ``features``, ``targets``, ``target_ids``: the score run's features.npy, targets.npy and
    targets.parquet (id, task), read by less and rds only."""
    import pandas as pd

    from clusterft.pipeline.io import write_json, write_parquet

    cfg = merge_cfg(cfg)
    if method == ORACLE and labels is None:
        raise InputError("method 'oracle' needs the labels file (labels.parquet)", field="labels")
    if method in TARGET_AWARE and None in (features, targets, target_ids):
        raise InputError(f"method '{method}' needs features, targets and target_ids",
                         field="targets")
    frames = {}
    for path, need in ((clusters, ("id", "cluster")), (scores, ("id", "score"))):
        if not os.path.exists(path):
            raise InputError("file does not exist", path=str(path))
        df = pd.read_parquet(path)
        for col in need:
            if col not in df.columns:
                raise InputError(f"no '{col}' column (has {list(df.columns)})", path=str(path),
                                 field=col)
        frames[path] = df
    aware = method in TARGET_AWARE
    checked = provenance.check_inputs({"clusters": clusters, "scores": scores,
                                       "labels": labels if method == ORACLE else None,
                                       "features": features if aware else None,
                                       "targets": targets if aware else None,
                                       "target_ids": target_ids if aware else None}, "select")
    pool_f = target_f = target_task = None
    if aware:
        pool_f, target_f = np.load(features), np.load(targets)
        target_task = pd.read_parquet(target_ids)["task"].astype(str).to_numpy() \
            if len(target_f) else np.array([], dtype=str)
        if len(target_task) != len(target_f):
            raise InputError(f"{len(target_task)} rows but {targets} has {len(target_f)}",
                             path=str(target_ids))
    cdf, sdf = frames[clusters], frames[scores]
    c_ids, s_ids = cdf["id"].astype(str).to_numpy(), sdf["id"].astype(str).to_numpy()
    if len(c_ids) != len(s_ids) or not (c_ids == s_ids).all():
        raise InputError(f"ids differ from {scores} (row counts {len(cdf)} vs {len(sdf)}); "
                         "both must come from the same score run", path=str(clusters), field="id")
    sim = cdf["centroid_sim"].to_numpy() if "centroid_sim" in cdf.columns else None
    groups = cdf["cluster"].to_numpy()
    if method == ORACLE:
        groups, sim = oracle_clusters(c_ids, labels), None
    idx = select(cdf["id"].to_numpy(), groups, sdf["score"].to_numpy(),
                 method, budget, cfg, seed, centroid_sim=sim, features=pool_f,
                 targets=target_f, target_task=target_task)
    per_epoch = rs2_subsets(len(c_ids), len(idx), epochs, seed) if method == RS2 else [idx]

    def rows(ix: np.ndarray) -> pd.DataFrame:
        return pd.DataFrame({"id": c_ids[ix], "cluster": groups[ix].astype(np.int64),
                             "score": sdf["score"].to_numpy()[ix].astype(np.float64)})

    out = rows(idx)
    if method == RS2:
        out = pd.concat([rows(ix).assign(epoch=np.int64(e)) for e, ix in enumerate(per_epoch)],
                        ignore_index=True)
    summary = summarize(groups, idx, method, budget, seed, cfg)
    if method == RS2:
        summary["epochs"] = len(per_epoch)
        summary["n_distinct"] = int(len(np.unique(np.concatenate(per_epoch))))
    write_parquet(out_selection, out)
    write_json(out_summary, summary)
    provenance.write({"selection": out_selection, "summary": out_summary}, "select", checked,
                     inherit=("clusters",), run_key="selection",
                     config={"method": method, "budget": budget, **cfg,
                             **({"epochs": int(epochs)} if method == RS2 else {})}, seed=seed)
    log.info("%s budget %s: %d of %d selected", method, budget, len(idx), len(cdf))
    return summary
