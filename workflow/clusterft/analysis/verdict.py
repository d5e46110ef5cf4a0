"""Why the method wins or loses: skill recovery, per-label coverage, paired comparisons on
per-item results, the power line and one verdict per claim of the paper.

Pure functions over tables plus small readers; ``clusterft.stages.report`` calls them and writes
the files. Every verdict is a fixed rule applied to the numbers (``verdict_*``), so a reader
can recompute it:

- a comparison's interval is the paired two-level bootstrap of ``clusterft.analysis.stats`` over seeds
  and items (``paired_comparison``), its standard error floored at ``report.min_se`` (the
  spread between CPUs);
- the **power line** of a dataset x model is the minimum detectable difference (alpha 0.05,
  power 0.8) of the oracle − random comparison, the reference selection that knows the true
  skills. Where oracle − random does not clear it, the benchmark cannot tell selections apart
  and a selection claim whose interval holds 0 is **inconclusive**; where it does and the
  method still ties random, the claim is **not reproduced** (a real negative).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.names import CLUSTER, FULL, ORACLE, RANDOM, REFERENCES
from clusterft.analysis.stats import cluster_agreement, mean_ci, paired_comparison, power_line

# The paper's two readings of its training-time claim (the seed text gives both).
TIME_READINGS = (("reduced to 69.6%", 0.696), ("10 h to about 3 h", 0.3))


def _read_parquet(path: str, what: str) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except FileNotFoundError as e:
        raise InputError(f"{what} does not exist", path=str(path)) from e


# ----------------------------------------------------------------------------- skill recovery
def skill_recovery(records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per clustering (dataset, model, seed, feature kind): ARI, NMI, purity and the
    share of true labels that are the majority label of some cluster, against labels.parquet."""
    rows, labels_cache = [], {}
    for r in records:
        c = _read_parquet(r["clusters"], "clusters")
        if r["labels"] not in labels_cache:
            lab = _read_parquet(r["labels"], "labels")
            labels_cache[r["labels"]] = dict(zip(lab["id"].astype(str), lab["label"].astype(str)))
        of = labels_cache[r["labels"]]
        ids = c["id"].astype(str)
        missing = [i for i in ids if i not in of]
        if missing:
            raise InputError(f"{len(missing)} clustered ids have no label (e.g. {missing[:3]}): "
                             "clusters and labels of different pools", path=str(r["clusters"]))
        agree = cluster_agreement(c["cluster"].to_numpy(), np.array([of[i] for i in ids]))
        rows.append({k: r[k] for k in ("dataset", "model", "seed", "features")} | agree
                    | {"n_labels": len(set(of.values()))})
    return pd.DataFrame(rows)


def skill_recovery_summary(sr: pd.DataFrame) -> pd.DataFrame:
    """Per dataset x model x feature kind: mean and 95% t half-width over seeds."""
    out = []
    for key, g in sr.groupby(["dataset", "model", "features"], sort=False):
        row = dict(zip(["dataset", "model", "features"], key))
        if "n_labels" in g:
            row["n_labels"] = int(g["n_labels"].max())
        for m in ("ari", "nmi", "purity", "label_coverage"):
            row[m], row[f"{m}_ci"], row["n_seeds"] = mean_ci(g[m].to_numpy())
        out.append(row)
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- label coverage
def label_counts(runs: Iterable[Mapping[str, Any]], labels: Mapping[str, str]) -> pd.DataFrame:
    """Per selection (dataset, model, method, budget, seed) and true label: pool and selected
    counts (RS2: its first epoch's subset). ``labels``: dataset -> labels.parquet."""
    rows, seen = [], set()
    for r in runs:
        sel = r.get("selection")
        if not sel or (isinstance(sel, float) and math.isnan(sel)):
            continue
        key = (r["dataset"], r["model"], r["method"], float(r["budget"]), int(r["seed"]))
        if key in seen:
            continue
        seen.add(key)
        lab = _read_parquet(labels[r["dataset"]], "labels")
        pool = lab["label"].astype(str).value_counts()
        s = _read_parquet(sel, "selection")
        if "epoch" in s.columns:
            s = s[s["epoch"] == 0]
        of = dict(zip(lab["id"].astype(str), lab["label"].astype(str)))
        chosen = pd.Series([of.get(i, "?") for i in s["id"].astype(str)]).value_counts()
        for label, n in pool.items():
            rows.append(dict(zip(["dataset", "model", "method", "budget", "seed"], key),
                             label=label, n_pool=int(n), n_selected=int(chosen.get(label, 0))))
    return pd.DataFrame(rows, columns=["dataset", "model", "method", "budget", "seed", "label",
                                       "n_pool", "n_selected"])


def label_summary(lc: pd.DataFrame) -> pd.DataFrame:
    """Per dataset x model x method x budget, means over seeds: labels with nothing selected,
    and the share of the selection from the rarer half of the labels (pool frequency below
    the median) next to that half's share of the pool — does a method keep rare skills?"""
    out = []
    for key, g in lc.groupby(["dataset", "model", "method", "budget"], sort=False):
        per_seed = []
        for _, s in g.groupby("seed"):
            rare = s["n_pool"] < s["n_pool"].median()
            per_seed.append(((s["n_selected"] == 0).sum(),
                             s.loc[rare, "n_selected"].sum() / max(1, s["n_selected"].sum()),
                             s.loc[rare, "n_pool"].sum() / s["n_pool"].sum()))
        a = np.array(per_seed, dtype=float)
        out.append(dict(zip(["dataset", "model", "method", "budget"], key),
                        n_labels=int(g["label"].nunique()), labels_missing=float(a[:, 0].mean()),
                        rare_share=float(a[:, 1].mean()), rare_share_pool=float(a[:, 2].mean()),
                        n_seeds=len(a)))
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- comparisons
def _items_matrix(runs: list[Mapping[str, Any]]) -> dict[int, pd.DataFrame]:
    """seed -> that run's per-item table (task, item, value)."""
    out = {}
    for r in runs:
        it = _read_parquet(r["items"], "per-item results")
        out[int(r["seed"])] = it[["task", "item", "value"]]
    return out


def compare(a_runs: list[Mapping[str, Any]], b_runs: list[Mapping[str, Any]],
            min_se: float = 0.0, n_boot: int = 2000, seed: int = 0) -> dict | None:
    """Paired comparison A − B on the items both were evaluated on, seeds paired by number
    (seed s of A and of B share the warm-up and training seeds). None when they share no
    seed or no item."""
    a, b = _items_matrix(a_runs), _items_matrix(b_runs)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    keys = None
    for s in seeds:
        k = set(map(tuple, a[s][["task", "item"]].to_numpy())) & set(
            map(tuple, b[s][["task", "item"]].to_numpy()))
        keys = k if keys is None else keys & k
    keys = sorted(keys)
    if not keys:
        return None
    idx = pd.MultiIndex.from_tuples(keys, names=["task", "item"])

    def mat(d: dict[int, pd.DataFrame]) -> np.ndarray:
        return np.stack([d[s].set_index(["task", "item"])["value"].reindex(idx).to_numpy(float)
                         for s in seeds])

    res = paired_comparison(mat(a), mat(b), np.array([t for t, _ in keys]), n_boot=n_boot,
                            seed=seed, min_se=min_se)
    return res


def comparisons(runs: pd.DataFrame, claim_budget: float, min_se: float = 0.0,
                n_boot: int = 2000) -> pd.DataFrame:
    """Every paired comparison the claims need, per dataset x model, at the claim budget on
    the accuracy runs: each method − random, each method − full, cluster − each baseline,
    and the distribution ablation (the same method, the other deal)."""
    ev = runs[runs["items"].notna()].copy()
    rows = []
    for (ds, model), g in ev.groupby(["dataset", "model"], sort=False):
        main = g[g["role"] != "ablation"]
        at = main[np.isclose(main["fraction"], claim_budget)]

        def pick(frame: pd.DataFrame, method: str) -> list[dict]:
            return frame[frame["method"] == method].to_dict("records")

        full = pick(main, FULL)
        methods = [m for m in dict.fromkeys(at["method"]) if m != FULL]
        pairs = [(m, RANDOM, pick(at, m), pick(at, RANDOM)) for m in methods if m != RANDOM]
        pairs += [(m, FULL, pick(at, m), full) for m in methods]
        pairs += [(CLUSTER, m, pick(at, CLUSTER), pick(at, m)) for m in methods
                  if m not in (CLUSTER, RANDOM) and m not in REFERENCES]
        abl = g[(g["role"] == "ablation") & np.isclose(g["fraction"], claim_budget)]
        for m in dict.fromkeys(abl["method"]):  # the same selection, the other deal
            ours, other = pick(at, m), pick(abl, m)
            if ours:
                pairs.append((f"{m} [{ours[0]['distribution']}]",
                              f"{m} [{other[0]['distribution']}]", ours, other))
        for a_name, b_name, a_runs, b_runs in pairs:
            if not a_runs or not b_runs:
                continue
            res = compare(a_runs, b_runs, min_se=min_se, n_boot=n_boot)
            if res is None:
                continue
            rows.append({"dataset": ds, "model": model, "a": a_name, "b": b_name,
                         "budget": claim_budget, **res})
    return pd.DataFrame(rows)


def _cmp(cmp: pd.DataFrame, ds: str, model: str, a: str, b: str) -> Mapping | None:
    r = cmp[(cmp["dataset"] == ds) & (cmp["model"] == model) & (cmp["a"] == a) & (cmp["b"] == b)]
    return None if r.empty else r.iloc[0]


def power_lines(cmp: pd.DataFrame) -> pd.DataFrame:
    """Per dataset x model: the MDE of oracle − random and whether oracle − random clears it."""
    rows = []
    for (ds, model), _ in cmp.groupby(["dataset", "model"], sort=False):
        r = _cmp(cmp, ds, model, ORACLE, RANDOM)
        if r is None:
            continue
        pl = power_line(float(r["se"]), float(r["diff"]))
        rows.append({"dataset": ds, "model": model, "oracle_minus_random": float(r["diff"]),
                     "ci_low": float(r["ci_low"]), "ci_high": float(r["ci_high"]),
                     "mde": pl["mde"], "clears": bool(pl["clears"]) and float(r["ci_low"]) > 0})
    return pd.DataFrame(rows, columns=["dataset", "model", "oracle_minus_random", "ci_low",
                                       "ci_high", "mde", "clears"])


# ----------------------------------------------------------------------------- verdicts
def verdict_better(r: Mapping, can_tell: bool | None) -> str:
    """A − B > 0? reproduced when the interval is above 0; 'B better' when below; a tie is
    a real negative only where the benchmark can tell selections apart (power line)."""
    if r["ci_low"] > 0:
        return "reproduced"
    if r["ci_high"] < 0:
        return "not reproduced (the other is better)"
    if can_tell:
        return "not reproduced (tie; the benchmark can tell selections apart)"
    if can_tell is None:
        return "inconclusive (no oracle run: power unknown)"
    return "inconclusive (oracle − random does not clear the detectable difference)"


def verdict_near(r: Mapping, tolerance: float) -> str:
    """A within ``tolerance`` of B (A − B ≥ −tolerance)? An equivalence reading of the
    interval: reproduced when all of it lies above −tolerance, not when all lies below."""
    if r["ci_low"] >= -tolerance:
        return "reproduced"
    if r["ci_high"] < -tolerance:
        return "not reproduced"
    return "inconclusive (interval straddles the tolerance)"


def _ci(r: Mapping) -> str:
    return f"{r['diff']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"


def speed_verdict(ratio: float, noise: float | None) -> str:
    """Balanced / random wall time read against the noise of such a ratio (2 sd; from the
    cost-model fit, clusterft.analysis.balancecost): within it, inconclusive; without a noise
    estimate, the bare ratio decides."""
    if noise is not None and np.isfinite(noise) and abs(ratio - 1) <= 2 * noise:
        return f"inconclusive (within the CPU-rank noise ±{2 * noise:.3f})"
    return "reproduced" if ratio < 1 else "not reproduced"


def claims_table(cmp: pd.DataFrame, tt: pd.DataFrame, sr: pd.DataFrame, ls: pd.DataFrame,
                 cfg: Mapping[str, Any], bt: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per claim and dataset x model (plus the diagnosis rows). ``bt``: the
    balance_cost table (clusterft.analysis.balancecost), whose noise and predictions qualify the
    distribution's speed claim."""
    b = float(cfg["claim_budget"])
    tol = float(cfg["near_full_tolerance"])
    pw = power_lines(cmp)
    cells = list(dict.fromkeys(map(tuple, pd.concat(
        [cmp[["dataset", "model"]], tt[["dataset", "model"]]]).to_numpy().tolist())))
    rows = []

    def add(claim: str, cell: tuple, paper: str, ours: str, test: str, verdict: str) -> None:
        rows.append({"claim": claim, "dataset": cell[0], "model": cell[1], "paper": paper,
                     "ours": ours, "test": test, "verdict": verdict})

    boot = "paired bootstrap over seeds x items, 95% CI"
    for cell in cells:
        p = pw[(pw["dataset"] == cell[0]) & (pw["model"] == cell[1])]
        can_tell = None if p.empty else bool(p.iloc[0]["clears"])
        r = _cmp(cmp, *cell, CLUSTER, FULL)
        add(f"accuracy kept at {b:.0%} of the data", cell, "almost the full-data accuracy",
            "not run" if r is None else f"cluster − full {_ci(r)}",
            f"{boot}; near = interval above −{tol:.3f}",
            "not evaluated" if r is None else verdict_near(r, tol))
        t = tt[(tt["dataset"] == cell[0]) & (tt["model"] == cell[1]) & (tt["method"] == CLUSTER)
               & np.isclose(tt["fraction"], b) & tt["ratio_to_full"].notna()]
        for tr in t.itertuples():
            v = "; ".join(f"vs '{name}' ({x:.3f}): "
                          + ("reproduced" if tr.ratio_to_full <= x else "not reproduced")
                          for name, x in TIME_READINGS)
            add("training time cut", cell, " / ".join(n for n, _ in TIME_READINGS),
                f"{tr.ratio_to_full:.3f} of full ({tr.gpus} GPU {tr.distribution}, "
                f"{tr.epochs} epochs, {tr.n_seeds} seeds)",
                "train wall time ratio, same GPUs/distribution/epochs/precision", v)
        for other in [x for x in dict.fromkeys(cmp["b"]) if x not in (FULL, ORACLE)]:
            r = _cmp(cmp, *cell, CLUSTER, other)
            if r is not None:
                add("better than usual selection", cell, "better than random and usual "
                    "selection", f"cluster − {other} {_ci(r)}", boot, verdict_better(r, can_tell))
        for r in cmp[(cmp["dataset"] == cell[0]) & (cmp["model"] == cell[1])
                     & cmp["a"].str.contains(r"\[", regex=True)].to_dict("records"):
            add("the distribution changes what is learnt", cell, "(the paper's deal is for "
                "speed; a fixed global batch gives DDP the same gradient)",
                f"{r['a']} − {r['b']} {_ci(r)}", boot, verdict_better(r, can_tell))
        t = tt[(tt["dataset"] == cell[0]) & (tt["model"] == cell[1])]
        keys = ["gpus", "method", "fraction", "epochs", "precision"]
        bal = t[t["distribution"] == "balanced"].set_index(keys)
        rnd = t[t["distribution"] == "random"].set_index(keys)
        for k in bal.index.intersection(rnd.index):
            if int(k[0]) < 2:  # one rank: no per-rank load to balance
                continue
            ratio = bal.loc[k, "wall_time_s_mean"] / rnd.loc[k, "wall_time_s_mean"]
            noise, model_note = None, ""
            if bt is not None and not bt.empty:
                m = bt[(bt["dataset"] == cell[0]) & (bt["model"] == cell[1])
                       & (bt["gpus"] == int(k[0])) & (bt["method"] == k[1])
                       & np.isclose(bt["budget"].astype(float), float(k[2]))]
                if not m.empty:
                    noise = float(m["ratio_noise"].mean()) / np.sqrt(len(m))
                    model_note = (f"; cost model predicts {m['predicted_ratio'].mean():.3f} "
                                  f"(fitted to the CPU runs), GPU default "
                                  f"{m['gpu_predicted_ratio'].mean():.3f}")
            add(f"faster than the usual distribution at {k[0]} GPUs", cell,
                "faster at 4 and 8 GPUs", f"balanced / random wall time {ratio:.3f} "
                f"({k[1]} {k[2]:.0%}, CPU ranks; token imbalance "
                f"{bal.loc[k, 'imbalance_mean']:.3f} vs {rnd.loc[k, 'imbalance_mean']:.3f}"
                f"{model_note})",
                "wall time ratio of seed means; noise from the cost-model fit "
                "(balance_cost)", speed_verdict(ratio, noise))
        if not p.empty:
            q = p.iloc[0]
            add("power line (diagnosis)", cell, "-",
                f"oracle − random {q['oracle_minus_random']:+.3f} [{q['ci_low']:+.3f}, "
                f"{q['ci_high']:+.3f}], detectable ≥ {q['mde']:.3f}",
                "MDE at alpha 0.05, power 0.8", "the benchmark can tell selections apart"
                if q["clears"] else "the benchmark cannot tell selections apart")
        s = sr[(sr["dataset"] == cell[0]) & (sr["model"] == cell[1])]
        unlabelled = "n_labels" in s and not s.empty and int(s["n_labels"].max()) < 2
        if unlabelled:  # a hub pool without a label column: one label, ARI 0 for all
            add("skill recovery (diagnosis)", cell, "clusters by the skill taught", "-",
                "ARI of clusters vs true labels", "not applicable: the pool carries no skill "
                "labels (map a `label` column to measure it)")
        elif not s.empty:
            add("skill recovery (diagnosis)", cell, "clusters by the skill taught",
                "; ".join(f"{x.features} ARI {x.ari:.2f}±{_nan(x.ari_ci)}" for x in s.itertuples()),
                "ARI of clusters vs true labels, mean ± 95% CI over seeds",
                "gradient best" if s.sort_values("ari").iloc[-1]["features"] == "gradient"
                else f"{s.sort_values('ari').iloc[-1]['features']} recovers skills best")
        lab = ls[(ls["dataset"] == cell[0]) & (ls["model"] == cell[1])
                 & np.isclose(ls["budget"], b)]
        if not lab.empty:
            add("rare skills kept (diagnosis)", cell, "every cluster kept",
                "; ".join(f"{x.method}: {x.labels_missing:.1f} of {x.n_labels} labels missing, "
                          f"rare half {x.rare_share:.0%} (pool {x.rare_share_pool:.0%})"
                          for x in lab.itertuples()),
                "per-label counts of each selection against the pool", "-")
    return pd.DataFrame(rows, columns=["claim", "dataset", "model", "paper", "ours", "test",
                                       "verdict"])


def _nan(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"
