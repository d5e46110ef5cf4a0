"""Tables, plots and a findings text from the result files of a sweep (never loads a model).

Input: run records `{dataset, model, method, budget, gpus, distribution, seed, eval_json,
train_metrics_json}` (a list of dicts, or a CSV/JSON file of them). `budget` is the
fraction of the pool (<= 1; a larger number is a count and needs a `pool_size` field);
method `full` defaults to budget 1 and method `base` (the model before fine-tuning, no
train metrics) to budget 0. `eval_json` / `train_metrics_json` may be empty.

Output (`run_report`): `accuracy_vs_data.{csv,md}`, `time.{csv,md}`, `balance_cost.{csv,md}`
(:mod:`clusterft.analysis.balancecost`), `findings.md` in the
tables folder; `accuracy_vs_data_<dataset>.png` and `time_<dataset>.png` in the plots folder.
Standard deviations are sample std over seeds (ddof=1; empty with one seed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.names import (BALANCED, BASE, CLUSTER, FULL, METHODS, RANDOM, RANDOM_SPLIT,
                    REFERENCES)
from clusterft.pipeline.sections import merge_section
from clusterft.pipeline.io import atomic_path, read_json, write_text
from clusterft.analysis.stats import mean_ci
from clusterft.analysis.balancecost import balance_markdown, balance_table, plan_work

DEFAULTS: dict[str, Any] = {
    # Budget fraction at which the paper's claims are checked (31% of the data).
    "claim_budget": 0.31,
    # Largest absolute drop in average accuracy (full minus cluster) still called "near full".
    "near_full_tolerance": 0.02,
    # Smallest standard error attached to a mean average accuracy, whatever the seeds show:
    # the same run on another CPU (other float kernels) gives another model, and with few
    # seeds the seed standard error can come out near zero by chance. 0.02: the SD of a cell's
    # seed mean between the native and the forced-AVX2 path of the embedded default, rounded
    # up (docs/cpus_and_precision.md).
    "min_se": 0.02,
    # Resolution of the PNG plots.
    "dpi": 110,
    # Bootstrap resamples of each paired comparison (clusterft.analysis.stats.paired_comparison).
    "n_boot": 2000,
}

REQUIRED = ("dataset", "model", "method", "seed")
KEY_ACC = ["dataset", "model", "method", "budget"]
KEY_TIME = ["dataset", "model", "gpus", "distribution", "method", "budget"]


# ----------------------------------------------------------------------------- loading
def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and
                                                                       v.strip() == "")


def read_run_table(runs: str | os.PathLike | Iterable[Mapping[str, Any]]) -> list[dict]:
    """Accept a list of dicts, or a CSV / JSON (list of objects) file of run records."""
    if isinstance(runs, (str, os.PathLike)):
        p = Path(runs)
        if p.suffix == ".csv":
            if not p.exists():
                raise InputError("run table does not exist", path=str(p))
            return pd.read_csv(p, keep_default_na=True, encoding="utf-8-sig").to_dict("records")
        data = read_json(p)
        if not isinstance(data, list):
            raise InputError("run table must be a JSON list of objects", path=str(p))
        return data
    return [dict(r) for r in runs]


def imbalance(per_rank_tokens_per_step: Any) -> float:
    """Mean over steps of max/mean tokens across ranks (1.0 = perfectly balanced)."""
    if not per_rank_tokens_per_step:
        return float("nan")
    vals = []
    for step in per_rank_tokens_per_step:
        a = np.asarray(step, dtype=float).ravel()
        if a.size and a.mean() > 0:
            vals.append(a.max() / a.mean())
    return float(np.mean(vals)) if vals else float("nan")


def _fraction(rec: Mapping[str, Any], i: int) -> float:
    method, budget = rec["method"], rec.get("budget")
    if _blank(budget):
        if method == FULL:
            return 1.0
        if method == BASE:
            return 0.0
        raise InputError("missing budget", path=f"run record {i}", field="budget")
    try:
        b = float(budget)
    except (TypeError, ValueError) as e:
        raise InputError(f"budget {budget!r} is not a number", path=f"run record {i}",
                         field="budget") from e
    if 0 <= b <= 1:
        return b
    pool = rec.get("pool_size")
    if b > 1 and not _blank(pool) and float(pool) > 0:
        return b / float(pool)
    raise InputError(f"budget {b} is not a fraction in [0, 1]; give pool_size to convert a "
                     "count", path=f"run record {i}", field="budget")


def load_runs(runs: Iterable[Mapping[str, Any]]) -> tuple[pd.DataFrame, list[str]]:
    """One row per run: keys, fraction, per-task accuracy, average, train metrics.

    Returns the frame and the task names (in first-seen order).
    """
    rows, tasks = [], []
    for i, rec in enumerate(runs):
        for f in REQUIRED:
            if _blank(rec.get(f)):
                raise InputError("missing field", path=f"run record {i}", field=f)
        row = {k: rec[k] for k in ("dataset", "model", "method")}
        row["seed"] = int(rec["seed"])
        row["fraction"] = _fraction(rec, i)
        row["budget"] = row["fraction"] if _blank(rec.get("budget")) else float(rec["budget"])
        row["gpus"] = None if _blank(rec.get("gpus")) else int(rec["gpus"])
        row["distribution"] = None if _blank(rec.get("distribution")) else str(rec["distribution"])
        # accuracy (default), ablation (the accuracy runs' other distribution) or time
        row["role"] = "accuracy" if _blank(rec.get("role")) else str(rec["role"])
        for f in ("items", "selection"):
            row[f] = None if _blank(rec.get(f)) else str(rec[f])
        ev = rec.get("eval_json")
        if not _blank(ev):
            res = read_json(ev)
            if not isinstance(res, dict) or not isinstance(res.get("tasks"), dict):
                raise InputError("eval results need a 'tasks' object", path=str(ev), field="tasks")
            for name, t in res["tasks"].items():
                if not isinstance(t, dict) or "value" not in t:
                    raise InputError("task entry needs a 'value'", path=str(ev),
                                     field=f"tasks.{name}.value")
                row[f"task:{name}"] = float(t["value"])
                if not _blank(t.get("n")):
                    row[f"n:{name}"] = int(t["n"])
                if name not in tasks:
                    tasks.append(name)
            row["average"] = float(res["average"]) if "average" in res else float(
                np.mean([float(t["value"]) for t in res["tasks"].values()]))
        tm = rec.get("train_metrics_json")
        if not _blank(tm):
            m = read_json(tm)
            for f in ("wall_time_s", "tokens", "steps"):
                if f not in m:
                    raise InputError("missing field in train metrics", path=str(tm), field=f)
            row["wall_time_s"] = float(m["wall_time_s"])
            row["tokens"] = float(m["tokens"])
            row["steps"] = float(m["steps"])
            row["epochs"] = str(int(m["epochs"])) if not _blank(m.get("epochs")) else "-"
            row["imbalance"] = imbalance(m.get("per_rank_tokens_per_step"))
            row["padded_work"] = plan_work(m.get("padded_tokens_per_step"))
            row["precision"] = str(m.get("precision") or "-")
            row["cpu"] = str((m.get("hardware") or {}).get("cpu") or "-")
        rows.append(row)
    if not rows:
        raise InputError("no run records", field="runs")
    df = pd.DataFrame(rows)
    for c in ("average", "wall_time_s", "tokens", "steps", "imbalance", "padded_work"):
        if c not in df:
            df[c] = np.nan
    for c in ("precision", "cpu"):
        df[c] = df[c].fillna("-") if c in df else "-"
    return df, tasks


# ----------------------------------------------------------------------------- tables
# Methods in table order (others after them, by name).
METHOD_RANK = {m: i for i, m in enumerate((BASE,) + METHODS)}


def _sort(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    rank = METHOD_RANK
    tmp = df.assign(_m=df["method"].map(lambda m: rank.get(m, len(rank))))
    by = [k if k != "method" else "_m" for k in keys]
    if "method" in keys:
        by.insert(by.index("_m") + 1, "method")
    return tmp.sort_values(by, kind="stable").drop(columns="_m").reset_index(drop=True)


def accuracy_table(df: pd.DataFrame, tasks: list[str], cfg: Mapping[str, Any] | None = None
                   ) -> pd.DataFrame:
    """dataset x model x method x budget: mean and std over seeds of each task and the average.

    Runs of one seed that differ only in gpus/distribution are averaged first, so each seed
    counts once.
    """
    cfg = {**DEFAULTS, **(cfg or {})}
    ev = df[df["average"].notna()]
    if "role" in ev:  # the distribution ablation is reported as a comparison, not a cell
        ev = ev[ev["role"] != "ablation"]
    cols = ["average"] + [f"task:{t}" for t in tasks]
    if ev.empty:
        return pd.DataFrame(columns=KEY_ACC + ["fraction", "n_seeds", "n_runs"])
    keys = KEY_ACC + ["fraction"]
    per_seed = ev.groupby(keys + ["seed"], dropna=False)[cols].mean().reset_index()
    runs = ev.groupby(keys, dropna=False).size().rename("n_runs")
    g = per_seed.groupby(keys, dropna=False)
    out = g.size().rename("n_seeds").to_frame().join(runs)
    for c in cols:
        name = c.removeprefix("task:")
        out[f"{name}_mean"] = g[c].mean()
        out[f"{name}_std"] = g[c].std(ddof=1)
    for t in tasks:
        if f"n:{t}" in ev:
            out[f"{t}_n"] = ev.groupby(keys, dropna=False)[f"n:{t}"].max()
    # 95% t interval over seeds (half-width), what tables and plots show.
    out["average_ci95"] = g["average"].agg(lambda v: mean_ci(v.to_numpy())[1])
    # One seed: no noise estimate at all (NaN), not the floor alone.
    seed_se = out["average_std"] / np.sqrt(out["n_seeds"])
    out["average_se"] = np.fmax(seed_se, float(cfg["min_se"])).where(out["n_seeds"] >= 2)
    # Every precision the group's runs trained in: a mix shows as "bf16+fp32", never silently.
    out["precision"] = ev.groupby(keys, dropna=False)["precision"].agg(
        lambda p: "+".join(sorted(set(p))))
    return _sort(out.reset_index(), KEY_ACC)


def time_table(df: pd.DataFrame) -> pd.DataFrame:
    """dataset x model x gpus x distribution x method x budget x epochs x precision: train
    time, tokens, imbalance, and the ratio to the full-data run with the same GPUs,
    distribution, epochs and precision (runs of other epoch counts or precisions are never
    each other's reference)."""
    tr = df[df["wall_time_s"].notna()].copy()
    if tr.empty:
        return pd.DataFrame(columns=KEY_TIME + ["fraction", "epochs", "precision", "n_seeds",
                                               "wall_time_s_mean"])
    tr["gpus"] = tr["gpus"].fillna(1).astype(int)
    tr["distribution"] = tr["distribution"].fillna("-")
    tr["epochs"] = tr["epochs"].fillna("-") if "epochs" in tr else "-"
    g = tr.groupby(KEY_TIME + ["fraction", "epochs", "precision"], dropna=False)
    out = pd.DataFrame({
        "n_seeds": g["seed"].nunique(),
        "wall_time_s_mean": g["wall_time_s"].mean(),
        "wall_time_s_std": g["wall_time_s"].std(ddof=1),
        "tokens_mean": g["tokens"].mean(),
        "steps_mean": g["steps"].mean(),
        "imbalance_mean": g["imbalance"].mean(),
    }).reset_index()
    ref_keys = ["dataset", "model", "gpus", "distribution", "epochs", "precision"]
    full = out[out["method"] == FULL].groupby(ref_keys)["wall_time_s_mean"].mean()
    full = full.rename("_full").reset_index()
    out = out.merge(full, on=ref_keys, how="left")
    out["ratio_to_full"] = out["wall_time_s_mean"] / out.pop("_full")
    return _sort(out, KEY_TIME)


# ----------------------------------------------------------------------------- markdown
def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        return f"{v:.{digits}f}"
    return str(v)


def to_markdown(df: pd.DataFrame, digits: int = 3) -> str:
    """A GitHub-flavoured markdown table (no tabulate dependency)."""
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        cells = [_fmt(v, digits).replace("|", "\\|").replace("\n", " ") for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pm(mean: Any, std: Any, digits: int = 3) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def accuracy_markdown(acc: pd.DataFrame, tasks: list[str]) -> str:
    """Accuracy table with mean ± std cells, the average's 95% t interval over seeds, the
    standard error the verdicts use for the average, and the training precision."""
    view = acc[["dataset", "model", "method", "fraction", "n_seeds"]].copy()
    view["fraction"] = view["fraction"].map(lambda f: f"{f:.0%}")
    for name in ["average"] + tasks:
        if f"{name}_mean" in acc:
            view[name] = [_pm(m, s) for m, s in zip(acc[f"{name}_mean"], acc[f"{name}_std"])]
        if name == "average" and "average_ci95" in acc:
            view["average (95% CI)"] = [_pm(m, c) for m, c in zip(acc["average_mean"],
                                                                 acc["average_ci95"])]
        if name == "average" and "average_se" in acc:
            view["average_se"] = acc["average_se"]
    if "precision" in acc:
        view["precision"] = acc["precision"]
    return to_markdown(view)


def time_markdown(tt: pd.DataFrame) -> str:
    """Time table: wall time mean ± std, tokens, steps, ratio to full, imbalance."""
    view = tt[["dataset", "model", "gpus", "distribution", "method", "fraction", "epochs",
               "precision", "n_seeds"]].copy()
    view["fraction"] = view["fraction"].map(lambda f: f"{f:.0%}")
    view["wall_time_s"] = [_pm(m, s, 1)
                           for m, s in zip(tt["wall_time_s_mean"], tt["wall_time_s_std"])]
    view["tokens"] = tt["tokens_mean"].map(lambda v: "" if math.isnan(v) else f"{v:.0f}")
    view["steps"] = tt["steps_mean"].map(lambda v: "" if math.isnan(v) else f"{v:.0f}")
    view["ratio_to_full"] = tt["ratio_to_full"]
    view["imbalance_max/mean"] = tt["imbalance_mean"]
    return to_markdown(view)


# ----------------------------------------------------------------------------- plots
def _chance(tasks: Iterable[str], task_specs: Mapping[str, Any] | None) -> float | None:
    if not task_specs:
        return None
    vals = []
    for t in tasks:
        spec = task_specs.get(t)
        ch = spec.get("chance") if isinstance(spec, Mapping) else getattr(spec, "chance", None)
        if ch is None:
            return None
        vals.append(float(ch))
    return float(np.mean(vals)) if vals else None


def _tasks_of(acc: pd.DataFrame, tasks: list[str]) -> list[str]:
    return [t for t in tasks if f"{t}_mean" in acc and acc[f"{t}_mean"].notna().any()]


def plot_accuracy(acc: pd.DataFrame, dataset: str, tasks: list[str], task_specs: Any,
                  cfg: Mapping[str, Any], out_png: str | os.PathLike) -> None:
    """Average accuracy vs budget fraction per method, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = acc[acc["dataset"] == dataset]
    models = list(dict.fromkeys(d["model"]))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4),
                             sharey=True, squeeze=False)
    chance = _chance(_tasks_of(d, tasks), task_specs)
    for ax, model in zip(axes[0], models):
        m = d[d["model"] == model]
        for method, g in m.groupby("method", sort=False):
            g = g.sort_values("fraction")
            ci = (g["average_ci95"] if "average_ci95" in g else g["average_std"]).fillna(0)
            yerr = ci.to_numpy()
            if method == FULL:
                y = g["average_mean"].iloc[-1]
                ax.axhline(y, color="black", ls="--", label=f"full ({y:.3f})")
                ax.axhspan(y - yerr[-1], y + yerr[-1], color="black", alpha=0.08)
            elif method == BASE:
                ax.axhline(g["average_mean"].iloc[0], color="gray", ls=":",
                           label=f"base ({g['average_mean'].iloc[0]:.3f})")
            else:
                ref = method in REFERENCES
                line = ax.errorbar(g["fraction"], g["average_mean"], yerr=yerr, capsize=3,
                                   marker="s" if ref else "o", ls=":" if ref else "-",
                                   label=method + (" (reference)" if ref else ""))
                if len(g) > 1:  # a band where there is a curve
                    ax.fill_between(g["fraction"], g["average_mean"] - yerr,
                                    g["average_mean"] + yerr, alpha=0.12,
                                    color=line.lines[0].get_color())
        if chance is not None:
            ax.axhline(chance, color="red", ls="-.", lw=0.8, label=f"chance ({chance:.3f})")
        ax.set_title(f"{dataset} / {model}")
        ax.set_xlabel("fraction of the pool")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("average accuracy over tasks (95% CI over seeds)")
    fig.tight_layout()
    _save(fig, out_png, cfg)


def plot_time(tt: pd.DataFrame, dataset: str, cfg: Mapping[str, Any],
              out_png: str | os.PathLike) -> None:
    """Bars of training wall time per gpus x distribution x method/budget, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = tt[tt["dataset"] == dataset]
    models = list(dict.fromkeys(d["model"]))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(max(5, 1.1 * len(d) + 2), 4),
                             squeeze=False)
    colors = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, model in zip(axes[0], models):
        m = _sort(d[d["model"] == model], ["gpus", "distribution", "method", "fraction"])
        several = d["epochs"].nunique() > 1
        labels = [f"{r.method} {r.fraction:.0%}\n{r.gpus} GPU {r.distribution}"
                  + (f"\n{r.epochs} ep" if several else "") for r in m.itertuples()]
        cols = [colors.setdefault(x, palette[len(colors) % len(palette)])
                for x in m["distribution"]]
        ax.bar(range(len(m)), m["wall_time_s_mean"], yerr=m["wall_time_s_std"].fillna(0),
               color=cols, capsize=3)
        ax.set_xticks(range(len(m)), labels, fontsize=7, rotation=45, ha="right",
                      rotation_mode="anchor")
        ax.set_ylabel("train wall time (s)")
        ax.set_title(f"{dataset} / {model}")
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch
    axes[0][-1].legend(handles=[Patch(color=c, label=k) for k, c in colors.items()],
                       title="distribution", fontsize=8)
    fig.tight_layout()
    _save(fig, out_png, cfg)


def _save(fig: Any, out_png: str | os.PathLike, cfg: Mapping[str, Any]) -> None:
    import matplotlib.pyplot as plt
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=cfg["dpi"], format="png")
    plt.close(fig)


# ----------------------------------------------------------------------------- findings
def _epochs(e: str) -> str:
    return "epochs unknown" if e == "-" else f"{e} epoch" + ("" if e == "1" else "s")


def _row(acc: pd.DataFrame, method: str, fraction: float) -> pd.Series | None:
    r = acc[(acc["method"] == method) & np.isclose(acc["fraction"], fraction, atol=1e-6)]
    return None if r.empty else r.iloc[0]


def _ms(r: pd.Series, col: str = "average") -> str:
    return f"{_pm(r[f'{col}_mean'], r[f'{col}_std'])} (n={int(r['n_seeds'])})"


def _se(r: pd.Series) -> float:
    """The row's standard error of the mean average: seed SE, at least report.min_se."""
    return float(r["average_se"])


def claim_lines(acc: pd.DataFrame, tt: pd.DataFrame, dataset: str, model: str,
                cfg: Mapping[str, Any]) -> list[str]:
    """Findings for one dataset/model: one bullet per claim, from the numbers alone."""
    b = float(cfg["claim_budget"])
    pct = f"{b:.0%}"
    a = acc[(acc["dataset"] == dataset) & (acc["model"] == model)]
    full = _row(a, FULL, 1.0)
    clu = _row(a, CLUSTER, b)
    rnd = _row(a, RANDOM, b)
    out = []

    # 1. near-full accuracy with 31% of the data
    head = f"**Near-full accuracy with {pct} of the data (cluster)**: "
    if full is None or clu is None:
        out.append(head + "not evaluated (needs full and cluster at this budget).")
    else:
        gap = full["average_mean"] - clu["average_mean"]
        ok = gap <= cfg["near_full_tolerance"]
        verdict = "reproduced" if ok else "not reproduced"
        out.append(head + f"{verdict}: cluster {_ms(clu)} vs full {_ms(full)}; full − cluster = "
                   f"{gap:+.3f} (tolerance {cfg['near_full_tolerance']:.3f}).")

    # 2. cluster beats random at equal budget
    head = f"**Cluster > random at equal budget ({pct})**: "
    if clu is None or rnd is None:
        out.append(head + "not evaluated (needs cluster and random at this budget).")
    else:
        diff = clu["average_mean"] - rnd["average_mean"]
        se = math.sqrt(_se(clu) ** 2 + _se(rnd) ** 2)
        if math.isnan(se):
            verdict = ("reproduced" if diff > 0 else "not reproduced") + \
                " (one seed: no noise estimate)"
        elif diff > 2 * se:
            verdict = "reproduced (difference beyond 2 standard errors)"
        elif diff < -2 * se:
            verdict = "not reproduced (random is better beyond 2 standard errors)"
        else:
            verdict = ("not reproduced: the difference is within seed noise "
                       f"(2 standard errors = {2 * se:.3f})")
        line = head + f"{verdict}: cluster {_ms(clu)} vs random {_ms(rnd)}; " \
                      f"cluster − random = {diff:+.3f}."
        others = []
        for _, r in a[a["method"] == CLUSTER].iterrows():
            o = _row(a, RANDOM, r["fraction"])
            if o is not None and not np.isclose(r["fraction"], b):
                others.append(f"{r['fraction']:.0%}: {r['average_mean'] - o['average_mean']:+.3f}")
        if others:
            line += " Other budgets (cluster − random): " + ", ".join(others) + "."
        out.append(line)

    # 3. training time reduction at 31%
    t = tt[(tt["dataset"] == dataset) & (tt["model"] == model)]
    several_prec = t["precision"].nunique() > 1 if "precision" in t else False
    head = (f"**Training time reduction at {pct} (cluster vs full, same GPUs/distribution/epochs/"
            "precision)**: ")
    pairs = t[(t["method"] == CLUSTER) & np.isclose(t["fraction"], b)
              & t["ratio_to_full"].notna()]
    if pairs.empty:
        out.append(head + "not evaluated (no full run with the same GPUs, distribution, epochs "
                   "and precision).")
    else:
        parts, oks = [], []
        for r in pairs.itertuples():
            oks.append(r.ratio_to_full < 1)
            full_s = r.wall_time_s_mean / r.ratio_to_full
            prec = f", {r.precision}" if several_prec else ""
            parts.append(f"{r.gpus} GPU {r.distribution}, {_epochs(r.epochs)}{prec}: "
                         f"{r.wall_time_s_mean:.1f} s vs full "
                         f"{full_s:.1f} s (ratio {r.ratio_to_full:.2f})")
        verdict = "reproduced" if all(oks) else ("partly reproduced" if any(oks)
                                                 else "not reproduced")
        out.append(head + f"{verdict}: " + "; ".join(parts) + ".")

    # 4. balanced vs random distribution
    head = "**Balanced distribution faster than random distribution**: "
    bal, rd = BALANCED, RANDOM_SPLIT
    keys = ["gpus", "method", "fraction", "epochs", "precision"]
    tb = t[t["distribution"] == bal].set_index(keys)
    tr = t[t["distribution"] == rd].set_index(keys)
    common = tb.index.intersection(tr.index)
    if len(common) == 0:
        out.append(head + "not evaluated (needs both distributions with the same GPUs, method, "
                   "budget, epochs and precision).")
    else:
        parts, oks = [], []
        for k in common:
            rb, rr = tb.loc[k], tr.loc[k]
            ratio = rb["wall_time_s_mean"] / rr["wall_time_s_mean"]
            oks.append(ratio < 1)
            prec = f", {k[4]}" if several_prec else ""
            parts.append(f"{k[0]} GPU {k[1]} {k[2]:.0%} ({_epochs(k[3])}{prec}): balanced "
                         f"{_pm(rb['wall_time_s_mean'], rb['wall_time_s_std'], 1)} s vs random "
                         f"{_pm(rr['wall_time_s_mean'], rr['wall_time_s_std'], 1)} s "
                         f"(ratio {ratio:.2f}, seeds {int(rb['n_seeds'])} vs {int(rr['n_seeds'])}; "
                         f"token imbalance max/mean {rb['imbalance_mean']:.3f} vs "
                         f"{rr['imbalance_mean']:.3f})")
        verdict = "reproduced" if all(oks) else ("partly reproduced" if any(oks)
                                                 else "not reproduced")
        out.append(head + f"{verdict}: " + "; ".join(parts) + ".")
    return out


def learnability(acc: pd.DataFrame, tasks: list[str]) -> pd.DataFrame:
    """Per model and task: does full-data fine-tuning beat the base model clearly?

    Clearly = full mean − base > 2 binomial standard errors of the difference (n items per
    task; one evaluation of the base model, the seed mean of full). Benchmarks on which
    fine-tuning on all the data does not move accuracy cannot tell selection methods apart.
    """
    rows = []
    for (ds, model), a in acc.groupby(["dataset", "model"], sort=False):
        full = _row(a, FULL, 1.0)
        base = a[a["method"] == BASE]
        if full is None or base.empty:
            continue
        base = base.iloc[0]
        for t in tasks:
            pf, pb = full.get(f"{t}_mean"), base.get(f"{t}_mean")
            if _blank(pf) or _blank(pb):
                continue
            n = full.get(f"{t}_n")
            n = float(n) if not _blank(n) else float("nan")
            se = math.sqrt((pf * (1 - pf) + pb * (1 - pb)) / n) if n == n else float("nan")
            diff = float(pf - pb)
            clear = bool(diff > 2 * se) if se == se else bool(diff > 0)
            rows.append({"dataset": ds, "model": model, "task": t, "base": float(pb),
                         "full": float(pf), "diff": diff, "two_se": 2 * se, "clear": clear})
    return pd.DataFrame(rows, columns=["dataset", "model", "task", "base", "full", "diff",
                                       "two_se", "clear"])


def learnability_lines(acc: pd.DataFrame, tasks: list[str]) -> list[str]:
    """Findings section: on how many tasks full-data fine-tuning clearly beats the base model."""
    lt = learnability(acc, tasks)
    if lt.empty:
        return []
    lines = ["## Benchmark check: full-data fine-tuning vs the base model", "",
             "A task counts when full − base exceeds 2 binomial standard errors. The pipeline "
             "issue asks for at least 6 of 8 tasks; fewer means the benchmarks are too hard for "
             "these models and budgets to tell methods apart.", ""]
    for model, t in lt.groupby("model", sort=False):
        weak = [f"{r.task} ({r.base:.3f} → {r.full:.3f})" for r in t.itertuples() if not r.clear]
        line = f"- **{model}**: {int(t['clear'].sum())} of {len(t)} tasks"
        line += "; not clearly: " + ", ".join(weak) + "." if weak else "."
        lines.append(line)
    return lines + [""]


def conditions_lines(df: pd.DataFrame) -> list[str]:
    """Findings section: the precisions and CPUs the training runs used (times depend on
    both; a table that mixes precisions says so in its precision column)."""
    tr = df[df["wall_time_s"].notna()]
    if tr.empty:
        return []
    lines = ["## Run conditions", ""]
    for col, what in (("precision", "Training precision"), ("cpu", "CPU of the training runs")):
        counts = tr[col].value_counts()
        lines.append(f"- {what}: " + ", ".join(f"{k} ({v} runs)" for k, v in counts.items())
                     + ("" if len(counts) == 1 else " — mixed: compare rows of one kind only")
                     + ".")
    return lines + [""]


def findings_text(acc: pd.DataFrame, tt: pd.DataFrame, cfg: Mapping[str, Any] | None = None,
                  tasks: list[str] | None = None,
                  df_conditions: pd.DataFrame | None = None) -> str:
    """The whole findings.md: per dataset and model, what the numbers say about each claim."""
    cfg = {**DEFAULTS, **(cfg or {})}
    lines = ["# Findings", "",
             "Generated from the result files by `clusterft.stages.report`; each verdict applies a "
             "fixed rule to the numbers below (near full: full − cluster ≤ "
             f"{cfg['near_full_tolerance']:.3f} average accuracy; cluster > random: difference "
             "beyond 2 standard errors, each the seed standard error but at least "
             f"{float(cfg['min_se']):.3f} (`report.min_se`, the spread between CPUs); time: "
             "ratio < 1). Small models and few seeds: read the numbers, not only the verdicts.",
             ""]
    lines += conditions_lines(df_conditions) if df_conditions is not None else []
    lines += learnability_lines(acc, tasks or [])
    pairs = pd.concat([acc[["dataset", "model"]], tt[["dataset", "model"]]]).drop_duplicates()
    for ds, model in pairs.itertuples(index=False):
        lines += [f"## {ds} / {model}", ""]
        lines += [f"- {x}" for x in claim_lines(acc, tt, ds, model, cfg)]
        lines.append("")
    return "\n".join(lines)


def claims_markdown(claims: pd.DataFrame, cfg: Mapping[str, Any]) -> str:
    """claims.md: one row per claim of the paper and dataset x model, then the diagnosis."""
    head = ["# Claims of the paper against this run", "",
            "Each verdict is a fixed rule on the numbers (clusterft.analysis.verdict): differences are "
            "average accuracy over the tasks, A − B, with a 95% interval from a paired "
            "bootstrap over seeds and items; standard errors are at least "
            f"{float(cfg['min_se']):.3f} (`report.min_se`). A selection claim whose interval "
            "holds 0 is *inconclusive* where oracle − random (the selection that knows the "
            "true skills) does not clear the minimum detectable difference — the benchmark "
            "cannot tell selections apart — and *not reproduced* where it does. The oracle is "
            "a reference, never a contender. Results are findings, not targets.", ""]
    if claims.empty:
        return "\n".join(head + ["(nothing to compare)", ""])
    main = claims[~claims["claim"].str.endswith("(diagnosis)")]
    diag = claims[claims["claim"].str.endswith("(diagnosis)")]
    return "\n".join(head) + "\n" + to_markdown(main) + "\n## Diagnosis\n\n" + to_markdown(diag)


# ----------------------------------------------------------------------------- entry point
def plot_skill_recovery(sr: pd.DataFrame, cfg: Mapping[str, Any],
                        out_png: str | os.PathLike) -> None:
    """ARI of each feature kind's clusters against the true labels, per dataset x model
    (mean and 95% CI over seeds): do gradient clusters find the skills?"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys(zip(sr["dataset"], sr["model"]))) if len(sr) else []
    kinds = list(dict.fromkeys(sr["features"])) if len(sr) else []
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(cells) + 2), 4))
    w = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        for i, cell in enumerate(cells):
            r = sr[(sr["dataset"] == cell[0]) & (sr["model"] == cell[1]) & (sr["features"] == kind)]
            if r.empty:
                continue
            ax.bar(i + j * w, r["ari"].iloc[0], w, yerr=np.nan_to_num(r["ari_ci"].iloc[0]),
                   capsize=2, color=f"C{j}", label=kind if i == 0 else None)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cells))],
                  [f"{d}\n{m}" for d, m in cells], fontsize=8)
    ax.set_ylabel("ARI vs true skill labels (95% CI)")
    ax.axhline(0, color="black", lw=0.6)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="features", fontsize=8)
    fig.tight_layout()
    _save(fig, out_png, cfg)


def run_report(runs: str | os.PathLike | Iterable[Mapping[str, Any]],
               out_dir_tables: str | os.PathLike, out_dir_plots: str | os.PathLike,
               task_specs: Mapping[str, Any] | Iterable[Any] | None = None,
               cfg: Mapping[str, Any] | None = None,
               clusterings: Iterable[Mapping[str, Any]] | None = None,
               labels: Mapping[str, str] | None = None,
               run_dir: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """Read every run's result files and write the tables, plots and findings.

    ``clusterings``: {dataset, model, seed, features, clusters, labels} records for the
    skill-recovery table; ``labels``: dataset -> labels.parquet for the per-label counts of
    the selections. With both, the diagnosis tables, the paired comparisons (from the runs'
    per-item results) and claims.md are written too. ``run_dir``: the run's folder (its
    ``benchmarks/out`` and ``results``), for selection_overhead.{csv,md} (clusterft.analysis.overhead:
    selection stages + training at the claim budget over full-data training).
    Returns {"tables": [...], "plots": [...]} with the paths written.
    """
    cfg = merge_section(DEFAULTS, cfg, "report")
    if task_specs is not None and not isinstance(task_specs, Mapping):
        task_specs = {(s["name"] if isinstance(s, Mapping) else s.name): s for s in task_specs}
    df, tasks = load_runs(read_run_table(runs))
    acc = accuracy_table(df, tasks, cfg)
    tt = time_table(df)
    tdir, pdir = Path(out_dir_tables), Path(out_dir_plots)
    written: dict[str, list[str]] = {"tables": [], "plots": []}

    def table(name: str, frame: pd.DataFrame, md: str) -> None:
        with atomic_path(tdir / f"{name}.csv") as tmp:
            frame.to_csv(tmp, index=False)
        write_text(tdir / f"{name}.md", md)
        written["tables"] += [str(tdir / f"{name}.csv"), str(tdir / f"{name}.md")]

    table("accuracy_vs_data", acc,
          accuracy_markdown(acc, tasks) if len(acc) else "(no evaluations)\n")
    table("time", tt, time_markdown(tt) if len(tt) else "(no training runs)\n")
    bt = balance_table(df)
    table("balance_cost", bt, balance_markdown(bt))
    write_text(tdir / "findings.md", findings_text(acc, tt, cfg, tasks, df))
    written["tables"].append(str(tdir / "findings.md"))
    if clusterings is not None and labels is not None:
        from clusterft.analysis import verdict

        sr = verdict.skill_recovery(clusterings)
        srs = verdict.skill_recovery_summary(sr) if len(sr) else pd.DataFrame(
            columns=["dataset", "model", "features", "ari", "ari_ci"])
        table("skill_recovery", sr, to_markdown(srs) if len(srs) else "(no clusterings)\n")
        lc = verdict.label_counts(df.to_dict("records"), labels)
        ls = verdict.label_summary(lc) if len(lc) else pd.DataFrame(
            columns=["dataset", "model", "method", "budget"])
        table("label_counts", lc, to_markdown(ls) if len(ls) else "(no selections)\n")
        cmp = verdict.comparisons(df, float(cfg["claim_budget"]), float(cfg["min_se"]),
                                  int(cfg["n_boot"]))
        table("comparisons", cmp, to_markdown(cmp) if len(cmp) else "(no paired runs)\n")
        claims = verdict.claims_table(cmp, tt, srs, ls, cfg, bt)
        write_text(tdir / "claims.md", claims_markdown(claims, cfg))
        written["tables"].append(str(tdir / "claims.md"))
        plot_skill_recovery(srs, cfg, pdir / "skill_recovery.png")
        written["plots"].append(str(pdir / "skill_recovery.png"))
    if run_dir is not None:
        from clusterft.analysis.overhead import write_tables

        written["tables"] += write_tables(run_dir, tdir, float(cfg["claim_budget"]))
    for ds in dict.fromkeys(df["dataset"]):
        p = pdir / f"accuracy_vs_data_{ds}.png"
        plot_accuracy(acc, ds, tasks, task_specs, cfg, p)
        p2 = pdir / f"time_{ds}.png"
        plot_time(tt, ds, cfg, p2)
        written["plots"] += [str(p), str(p2)]
    return written
