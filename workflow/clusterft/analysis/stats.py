"""Statistics behind the report's verdicts: pure functions over numpy arrays.

- `mean_ci`: every accuracy is reported as mean +- a 95% Student-t half-width over seeds,
  because the seed (one whole selection + training run) is the unit of replication.
- `paired_comparison`: two selection methods compared on the same benchmark items, by a
  two-level paired bootstrap (seeds and items), so that both run-to-run noise and the finite
  size of the benchmark enter the uncertainty.
- `minimum_detectable_difference` / `power_line`: the smallest difference the design could
  detect; if even oracle - random does not clear it, the benchmark cannot tell selections apart
  and any claim from it is inconclusive.

No torch, no file I/O: the callers read the per-item results and pass arrays.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

__all__ = ["mean_ci", "paired_comparison", "minimum_detectable_difference", "power_line"]

# Replicates per vectorised block: bounds the (block, n_items) work arrays to a few MB.
_BLOCK_CELLS = 1_000_000


def mean_ci(values, level: float = 0.95) -> tuple[float, float, int]:
    """Mean, Student-t half-width and n of `values` (one number per seed).

    Student-t rather than normal because n (seeds) is small. NaNs (a run that produced no
    number) are dropped before counting n. n == 1 gives a nan half-width (no spread can be
    estimated from one run, and 0 would claim false precision); empty gives (nan, nan, 0).
    """
    from scipy.stats import t as student_t  # scipy comes with scikit-learn

    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=float).ravel()
    x = x[~np.isnan(x)]
    n = int(x.size)
    if n == 0:
        return math.nan, math.nan, 0
    mean = float(x.mean())
    if n == 1:
        return mean, math.nan, 1
    sem = float(x.std(ddof=1)) / math.sqrt(n)
    half = float(student_t.ppf(0.5 + level / 2.0, n - 1)) * sem
    return mean, half, n


def minimum_detectable_difference(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """(z_{1-alpha/2} + z_{power}) * se: the true difference a two-sided test at `alpha` would
    detect with probability `power`, given the standard error `se` of the estimated difference.

    Normal approximation (the bootstrap distribution of a mean over many items is close to
    normal); it ignores the chance of rejecting in the wrong direction, negligible at 80% power.
    """
    if not 0.0 < alpha < 1.0 or not 0.0 < power < 1.0:
        raise ValueError(f"alpha and power must be in (0, 1), got {alpha}, {power}")
    z = NormalDist()
    return float((z.inv_cdf(1.0 - alpha / 2.0) + z.inv_cdf(power)) * se)


def power_line(se: float, observed: float, alpha: float = 0.05, power: float = 0.8) -> dict:
    """The MDE for `se` and whether `observed` clears it (abs(observed) >= mde).

    Used on oracle - random: if the largest gap selection could make does not clear the MDE,
    the benchmark cannot tell selections apart and a comparison of methods is inconclusive.
    """
    mde = minimum_detectable_difference(se, alpha=alpha, power=power)
    return {"mde": mde, "observed": float(observed), "clears": bool(abs(observed) >= mde)}


def _check_inputs(a, b, task_of_item) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    tasks = np.asarray(task_of_item)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D [n_seeds, n_items], "
                         f"got shapes {a.shape} and {b.shape}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape (paired seeds and items), "
                         f"got {a.shape} and {b.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"empty input: a and b have shape {a.shape}, need >= 1 seed and >= 1 item")
    if tasks.ndim != 1 or tasks.shape[0] != a.shape[1]:
        raise ValueError(f"task_of_item must be 1-D with one entry per item ({a.shape[1]}), "
                         f"got shape {tasks.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite (a missing per-item score would unpair the items)")
    return a, b, tasks


def paired_comparison(a, b, task_of_item, level: float = 0.95, n_boot: int = 2000,
                      seed: int = 0, min_se: float = 0.0) -> dict:
    """Difference of macro averages of method A and method B, with a paired bootstrap CI.

    a, b: [n_seeds, n_items] per-item scores on the SAME items (tasks concatenated), row s of
    `a` paired with row s of `b`. task_of_item: [n_items] task name of each item.

    Statistic: mean over tasks of (mean over seeds and items of that task) of a - b, so every
    task weighs the same whatever its size (as the report's macro average does).

    Inference: a two-level paired bootstrap. Each replicate resamples seeds with replacement
    (a seed is a whole selection + training run, the unit of replication) and, independently,
    items with replacement within each task (task sizes are kept, so the macro weights are
    fixed); the same indices are used for a and b, so what is shared by both methods on a seed
    or an item cancels. Known biases of this crossed bootstrap: the seed x item noise (a model
    answering an item differently from run to run) is counted at both levels,
    (2 - 1/n_seeds) * (2 - 1/n_t) - 1 times instead of once, which makes se conservative
    when per-item noise dominates (the usual case with hundreds of items per task); the
    seed level shrinks the run-to-run variance by (n_seeds - 1) / n_seeds and is coarse with
    few seeds, which makes the interval too narrow when run-to-run effects dominate.
    More seeds help both.

    Returns diff, ci_low/ci_high (percentile interval at `level`), se (bootstrap SD, floored at
    `min_se`, the caller's floor for the spread between CPUs; the floor enters se and mde only,
    not the CI or p), p, n_seeds, n_items, n_tasks and mde (minimum_detectable_difference of
    that se at alpha = 1 - level, power 0.8).

    p is two-sided from the bootstrap distribution: 2 * min(P(boot <= 0), P(boot >= 0)),
    clipped to [1/(n_boot + 1), 1]: p < 1 - level when 0 is outside the percentile CI (up to
    quantile interpolation), so p and CI never disagree;
    the lower clip says that n_boot replicates cannot resolve a smaller p (never report 0); if
    all replicates are exactly 0 (identical a and b) p is 1.

    Deterministic in `seed` (numpy default_rng).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    n_boot = int(n_boot)
    a, b, tasks = _check_inputs(a, b, task_of_item)
    n_seeds, n_items = a.shape

    names, inverse = np.unique(tasks, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    d = (a - b)[:, order]  # items grouped by task
    sizes = np.bincount(inverse, minlength=len(names))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n_tasks = len(names)
    # Per-task weight of a resampled sum: 1 / (n_seeds * n_t), then the mean over tasks.
    task_w = 1.0 / (n_seeds * sizes * n_tasks)

    diff = float((np.add.reduceat(d.sum(axis=0), starts) * task_w).sum())

    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    block = max(1, _BLOCK_CELLS // n_items)
    starts_of_item = np.repeat(starts, sizes)  # the first column of each item's task
    size_of_item = np.repeat(sizes, sizes)
    for lo in range(0, n_boot, block):
        m = min(block, n_boot - lo)
        # Resampling = how many times each seed / item is drawn: draw indices, count them.
        rows = np.arange(m)[:, None]
        seed_idx = rng.integers(0, n_seeds, size=(m, n_seeds))
        seed_counts = np.bincount((rows * n_seeds + seed_idx).ravel(),
                                  minlength=m * n_seeds).reshape(m, n_seeds).astype(float)
        # Within each task: an index in [start, start + n_t) for each of the task's n_t slots.
        item_idx = starts_of_item + rng.integers(0, size_of_item, size=(m, n_items))
        item_counts = np.bincount((rows * n_items + item_idx).ravel(),
                                  minlength=m * n_items).reshape(m, n_items)
        per_item = seed_counts @ d  # [m, n_items]: sum over the resampled seeds
        per_task = np.add.reduceat(per_item * item_counts, starts, axis=1)  # [m, n_tasks]
        boot[lo:lo + m] = per_task @ task_w

    tail = (1.0 - level) / 2.0
    ci_low, ci_high = (float(v) for v in np.quantile(boot, [tail, 1.0 - tail]))
    se = max(float(boot.std(ddof=1)) if n_boot > 1 else 0.0, float(min_se))
    p_two = 2.0 * min(float(np.mean(boot <= 0.0)), float(np.mean(boot >= 0.0)))
    p = float(min(1.0, max(1.0 / (n_boot + 1), p_two)))
    return {
        "diff": diff,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "se": se,
        "p": p,
        "n_seeds": int(n_seeds),
        "n_items": int(n_items),
        "n_tasks": int(n_tasks),
        "mde": minimum_detectable_difference(se, alpha=1.0 - level),
    }


def cluster_agreement(labels, true_labels) -> dict:
    """Agreement of clusters with hidden true labels (skill recovery): ARI, NMI, purity and
    label_coverage (all in [0, 1]*).

    Purity: the fraction of examples whose cluster's most common true label is their own.
    Label coverage: the fraction of true labels that are the most common label of at least
    one cluster (a skill that owns a cluster; ties go to the label sorted first).
    (*ARI can be slightly negative for worse-than-chance clusterings.)
    """
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    a, b = np.asarray(labels), np.asarray(true_labels)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"labels and true_labels must be 1-D of one length, got {a.shape}, {b.shape}")
    _, bi = np.unique(b, return_inverse=True)
    _, ai = np.unique(a, return_inverse=True)
    table = np.zeros((ai.max() + 1, bi.max() + 1), dtype=np.int64)
    np.add.at(table, (ai, bi), 1)
    return {"ari": float(adjusted_rand_score(b, a)),
            "nmi": float(normalized_mutual_info_score(b, a)),
            "purity": float(table.max(1).sum() / len(a)),
            "label_coverage": float(len(np.unique(table.argmax(1))) / table.shape[1]),
            "n_clusters": int(table.shape[0]), "n_labels": int(table.shape[1])}
