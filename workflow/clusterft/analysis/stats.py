"""Statistics behind the report's verdicts: pure functions over numpy arrays.

- `mean_ci`: every accuracy is reported as mean +- a 95% Student-t half-width over seeds,
  because the seed (one whole selection + training run) is the unit of replication.
- `paired_comparison`: two selection methods compared on the same benchmark items, by a
  two-level paired bootstrap (seeds and items), so that both run-to-run noise and the finite
  size of the benchmark enter the uncertainty.
- `minimum_detectable_difference` / `power_line`: the smallest difference the design could
  detect; if even oracle - random does not clear it, the benchmark cannot tell selections apart
  and any claim from it is inconclusive. One-sided (`one_sided=True`) for a non-inferiority
  test, whose power question is: could this design reject a gap larger than the margin?
- `gain_share`: (a - b) / (c - b) with a joint paired bootstrap interval, e.g. the share of the
  oracle's gain over random that the method recovers.

No torch, no file I/O: the callers read the per-item results and pass arrays.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

__all__ = ["mean_ci", "paired_comparison", "minimum_detectable_difference", "power_line",
           "gain_share"]

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


def minimum_detectable_difference(se: float, alpha: float = 0.05, power: float = 0.8,
                                  one_sided: bool = False) -> float:
    """(z_{1-alpha/2} + z_{power}) * se: the true difference a two-sided test at `alpha` would
    detect with probability `power`, given the standard error `se` of the estimated difference.
    `one_sided`: (z_{1-alpha} + z_{power}) * se, for a one-sided test (non-inferiority: the
    gap beyond the margin that a one-sided test at `alpha` would reject with that power).

    Normal approximation (the bootstrap distribution of a mean over many items is close to
    normal); it ignores the chance of rejecting in the wrong direction, negligible at 80% power.
    """
    if not 0.0 < alpha < 1.0 or not 0.0 < power < 1.0:
        raise ValueError(f"alpha and power must be in (0, 1), got {alpha}, {power}")
    z = NormalDist()
    tail = alpha if one_sided else alpha / 2.0
    return float((z.inv_cdf(1.0 - tail) + z.inv_cdf(power)) * se)


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


def _bootstrap(d: np.ndarray, tasks: np.ndarray, n_boot: int, seed: int
               ) -> tuple[float, np.ndarray, int]:
    """Macro-average statistic of the [n_seeds, n_items] matrix `d` and its `n_boot` two-level
    bootstrap replicates (see `paired_comparison`). The resampled seeds and items depend only
    on `seed` and the shapes, never on `d`: two matrices of one shape bootstrapped with one
    `seed` share every resample, which is what makes `gain_share`'s ratio a joint bootstrap."""
    n_seeds, n_items = d.shape
    names, inverse = np.unique(tasks, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    d = d[:, order]  # items grouped by task
    sizes = np.bincount(inverse, minlength=len(names))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n_tasks = len(names)
    # Per-task weight of a resampled sum: 1 / (n_seeds * n_t), then the mean over tasks.
    task_w = 1.0 / (n_seeds * sizes * n_tasks)

    stat = float((np.add.reduceat(d.sum(axis=0), starts) * task_w).sum())

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
    return stat, boot, n_tasks


def _check_level(level: float, n_boot: int) -> int:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    return int(n_boot)


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

    Returns diff, ci_low/ci_high (percentile interval at `level`), ci_low_1s/ci_high_1s (the
    one-sided bounds at `level`: the 1 - level and level quantiles, what a non-inferiority
    test at alpha = 1 - level reads), se (bootstrap SD, floored at `min_se`), p, n_seeds,
    n_items, n_tasks and mde (minimum_detectable_difference of that se at alpha = 1 - level,
    power 0.8).

    `min_se` is the caller's floor for the spread between machines (CPU kinds: other float
    kernels train other models). Pass it only when the two sides were measured on different
    machines: in a paired comparison of runs of one machine the machine's offset is shared by
    both sides and cancels, so flooring that se would only hide real power (0.02 forces an
    MDE of at least 0.056). The floor enters se and mde only, not the CI or p.

    p is two-sided from the bootstrap distribution: 2 * min(P(boot <= 0), P(boot >= 0)),
    clipped to [1/(n_boot + 1), 1]: p < 1 - level when 0 is outside the percentile CI (up to
    quantile interpolation), so p and CI never disagree;
    the lower clip says that n_boot replicates cannot resolve a smaller p (never report 0); if
    all replicates are exactly 0 (identical a and b) p is 1.

    Deterministic in `seed` (numpy default_rng).
    """
    n_boot = _check_level(level, n_boot)
    a, b, tasks = _check_inputs(a, b, task_of_item)
    n_seeds, n_items = a.shape
    diff, boot, n_tasks = _bootstrap(a - b, tasks, n_boot, seed)

    tail = (1.0 - level) / 2.0
    ci_low, ci_high = (float(v) for v in np.quantile(boot, [tail, 1.0 - tail]))
    low_1s, high_1s = (float(v) for v in np.quantile(boot, [1.0 - level, level]))
    se = max(float(boot.std(ddof=1)) if n_boot > 1 else 0.0, float(min_se))
    p_two = 2.0 * min(float(np.mean(boot <= 0.0)), float(np.mean(boot >= 0.0)))
    p = float(min(1.0, max(1.0 / (n_boot + 1), p_two)))
    return {
        "diff": diff,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "ci_low_1s": low_1s,
        "ci_high_1s": high_1s,
        "se": se,
        "p": p,
        "n_seeds": int(n_seeds),
        "n_items": int(n_items),
        "n_tasks": int(n_tasks),
        "mde": minimum_detectable_difference(se, alpha=1.0 - level),
    }


def gain_share(a, b, c, task_of_item, level: float = 0.95, n_boot: int = 2000,
               seed: int = 0) -> dict:
    """(a - b) / (c - b) of the macro averages, with a percentile interval from one joint
    paired bootstrap of the three [n_seeds, n_items] matrices (the same resampled seeds and
    items in numerator and denominator, so what they share cancels).

    The use: a = the method, b = random, c = the oracle: the share of the gain that knowing
    the true skills buys which the method recovers (1 = all of it, 0 = none, < 0 = worse than
    random). Only meaningful where c - b is clearly positive (the positive control passed):
    near a zero denominator the ratio and its interval explode, and replicates whose
    denominator is not positive are left out of the interval (their count: n_dropped).
    """
    n_boot = _check_level(level, n_boot)
    a, b, tasks = _check_inputs(a, b, task_of_item)
    c, _, _ = _check_inputs(c, b, task_of_item)
    num, boot_num, _ = _bootstrap(a - b, tasks, n_boot, seed)
    den, boot_den, _ = _bootstrap(c - b, tasks, n_boot, seed)
    ok = boot_den > 0
    share = num / den if den > 0 else math.nan
    tail = (1.0 - level) / 2.0
    if ok.any():
        lo, hi = (float(v) for v in np.quantile(boot_num[ok] / boot_den[ok], [tail, 1 - tail]))
    else:
        lo = hi = math.nan
    return {"share": float(share), "ci_low": lo, "ci_high": hi, "gain": float(num),
            "possible": float(den), "n_dropped": int((~ok).sum())}


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
