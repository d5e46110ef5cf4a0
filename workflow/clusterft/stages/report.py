"""Tables, plots and a findings text from the result files of a sweep (never loads a model).

Input: run records `{dataset, model, method, budget, gpus, distribution, seed, eval_json,
train_metrics_json}` (a list of dicts, or a CSV/JSON file of them). `budget` is the
fraction of the pool (<= 1; a larger number is a count and needs a `pool_size` field);
method `full` defaults to budget 1 and method `base` (the model before fine-tuning, no
train metrics) to budget 0. `eval_json` / `train_metrics_json` may be empty.

Output (`run_report`): `accuracy_vs_data.{csv,md}`, `time.{csv,md}`, `balance_cost.{csv,md}`
(:mod:`clusterft.analysis.balancecost`), `comparisons.{csv,md}`, `claims.md` and `findings.md`
in the tables folder; `accuracy_vs_data_<dataset>.png`, `time_<dataset>.png` and
`comparisons_<dataset>.png` in the plots folder. Every verdict of claims.md and findings.md
comes from one function, :func:`clusterft.analysis.verdict.claims_table`.
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
from clusterft.pipeline.names import (BASE, CLUSTER, FULL, METHODS, ORACLE, RANDOM, REFERENCES,
                                      STEPS_LABEL)
from clusterft.pipeline.sections import merge_section
from clusterft.pipeline.io import atomic_path, read_json, write_text
from clusterft.analysis.stats import mean_ci
from clusterft.analysis.balancecost import balance_markdown, balance_table, plan_work

DEFAULTS: dict[str, Any] = {
    # Budget fraction at which the paper's claims are checked (31% of the data).
    "claim_budget": 0.31,
    # Non-inferiority margin of the near-full claim, declared before the run as a share of
    # full's gain over the base model: 0.2 = cluster keeps at least 80% of what fine-tuning on
    # all the data adds. The absolute margin (share x (full - base) of each dataset x model)
    # is reported; near full is reproduced when the one-sided 95% lower bound of
    # cluster - full lies above -margin. Why a share: "almost the full-data accuracy" is
    # only meaningful against the gain that fine-tuning buys; an absolute tolerance is
    # strict on a benchmark where that gain is large and vacuous where it is small.
    "near_full_margin": 0.2,
    # Smallest standard error where machines are compared, whatever the seeds show: the same
    # run on another CPU kind (other float kernels) gives another model, and with few seeds
    # the seed standard error can come out near zero by chance. Applied to the cross-run SE
    # of accuracy_vs_data's averages and to paired comparisons whose runs trained on
    # different CPUs; never to paired comparisons of one machine's runs, where the machine's
    # offset cancels. 0.02: the SD of a cell's seed mean between the native and the
    # forced-AVX2 path of the embedded default, rounded up (docs/cpus_and_precision.md).
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
            # padding-free packed micro-batches or padded ones (train.packing)
            row["packing"] = {True: "packed", False: "padded"}.get(m.get("packing"), "-")
            row["cpu"] = str((m.get("hardware") or {}).get("cpu") or "-")
        rows.append(row)
    if not rows:
        raise InputError("no run records", field="runs")
    df = pd.DataFrame(rows)
    for c in ("average", "wall_time_s", "tokens", "steps", "imbalance", "padded_work"):
        if c not in df:
            df[c] = np.nan
    for c in ("precision", "packing", "cpu"):
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
        ev = ev[ev["role"] != "ablation"].copy()
        # the step-matched arm: rows of their own beside the paper protocol's
        sm = ev["role"] == "step_matched"
        ev.loc[sm, "method"] = ev.loc[sm, "method"] + STEPS_LABEL
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
    """dataset x model x gpus x distribution x method x budget x epochs x precision x packing:
    train time, tokens, imbalance, and the ratio to the full-data run with the same GPUs,
    distribution, epochs, precision and packing (padding-free or padded micro-batches; runs
    of other epoch counts, precisions or packings are never each other's reference)."""
    tr = df[df["wall_time_s"].notna()].copy()
    if tr.empty:
        return pd.DataFrame(columns=KEY_TIME + ["fraction", "epochs", "precision", "packing",
                                               "n_seeds", "wall_time_s_mean"])
    tr["gpus"] = tr["gpus"].fillna(1).astype(int)
    tr["distribution"] = tr["distribution"].fillna("-")
    tr["epochs"] = tr["epochs"].fillna("-") if "epochs" in tr else "-"
    tr["packing"] = tr["packing"].fillna("-") if "packing" in tr else "-"
    g = tr.groupby(KEY_TIME + ["fraction", "epochs", "precision", "packing"], dropna=False)
    out = pd.DataFrame({
        "n_seeds": g["seed"].nunique(),
        "wall_time_s_mean": g["wall_time_s"].mean(),
        "wall_time_s_std": g["wall_time_s"].std(ddof=1),
        "tokens_mean": g["tokens"].mean(),
        "steps_mean": g["steps"].mean(),
        "imbalance_mean": g["imbalance"].mean(),
    }).reset_index()
    ref_keys = ["dataset", "model", "gpus", "distribution", "epochs", "precision", "packing"]
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
               "precision", "packing", "n_seeds"]].copy()
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
def _row(acc: pd.DataFrame, method: str, fraction: float) -> pd.Series | None:
    r = acc[(acc["method"] == method) & np.isclose(acc["fraction"], fraction, atol=1e-6)]
    return None if r.empty else r.iloc[0]


def _ms(r: pd.Series, col: str = "average") -> str:
    return f"{_pm(r[f'{col}_mean'], r[f'{col}_std'])} (n={int(r['n_seeds'])})"


def claim_lines(claims: pd.DataFrame, acc: pd.DataFrame, dataset: str, model: str,
                cfg: Mapping[str, Any]) -> list[str]:
    """Findings for one dataset/model: one bullet per row of the claims table
    (clusterft.analysis.verdict.claims_table) with its verdict word for word, so findings.md
    and claims.md cannot disagree; then the seed means behind the accuracy claims (numbers,
    no verdict)."""
    c = claims[(claims["dataset"] == dataset) & (claims["model"] == model)]
    out = [f"**{r.claim}**: **{r.verdict}** — {r.ours}." for r in c.itertuples()]
    b = float(cfg["claim_budget"])
    a = acc[(acc["dataset"] == dataset) & (acc["model"] == model)]
    means = [f"{m} {_ms(r)}" for m, f in ((BASE, 0.0), (FULL, 1.0), (CLUSTER, b), (RANDOM, b))
             if (r := _row(a, m, f)) is not None]
    if means:
        out.append(f"Seed means of the average accuracy (± std over seeds), budget {b:.0%}: "
                   + "; ".join(means) + ".")
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
                  df_conditions: pd.DataFrame | None = None,
                  claims: pd.DataFrame | None = None) -> str:
    """The whole findings.md: per dataset and model, the claims table's rows as bullets.

    ``claims``: clusterft.analysis.verdict.claims_table's output, the one decider (run_report
    passes the one it writes to claims.md). Without it the table is built here from the time
    table alone: the accuracy claims then say 'not evaluated' (their verdicts need the
    per-item results), rather than a second rule judging them from seed means.
    """
    from clusterft.analysis import verdict

    cfg = {**DEFAULTS, **(cfg or {})}
    if claims is None:
        claims = verdict.claims_table(pd.DataFrame(columns=verdict.CMP_COLUMNS), tt,
                                      pd.DataFrame(columns=["dataset", "model"]),
                                      pd.DataFrame(columns=["dataset", "model", "budget"]), cfg)
    lines = ["# Findings", "",
             "Generated from the result files by `clusterft.stages.report`. Every verdict below "
             "is the verdict column of claims.md for the same claim and dataset x model "
             "(`clusterft.analysis.verdict.claims_table`: one rule on one set of numbers; the "
             "rules are stated in claims.md). Small models and few seeds: read the numbers, "
             "not only the verdicts.", ""]
    lines += [f"- {n}" for n in verdict.NOTES] + [""]
    lines += conditions_lines(df_conditions) if df_conditions is not None else []
    lines += learnability_lines(acc, tasks or [])
    pairs = pd.concat([claims[["dataset", "model"]], acc[["dataset", "model"]],
                       tt[["dataset", "model"]]]).drop_duplicates()
    for ds, model in pairs.itertuples(index=False):
        lines += [f"## {ds} / {model}", ""]
        lines += [f"- {x}" for x in claim_lines(claims, acc, ds, model, cfg)]
        lines.append("")
    return "\n".join(lines)


def claims_markdown(claims: pd.DataFrame, cfg: Mapping[str, Any]) -> str:
    """claims.md: one row per claim of the paper and dataset x model, the notes (readings
    that are not verdicts), then the diagnosis."""
    from clusterft.analysis.verdict import NOTES

    head = ["# Claims of the paper against this run", "",
            "Each verdict is a fixed rule on the numbers (clusterft.analysis.verdict.claims_table; "
            "findings.md shows the same verdicts): differences are average accuracy over the "
            "tasks, A − B, with a 95% interval from a paired bootstrap over seeds and items. "
            "Paired runs of one machine keep their bootstrap standard error; "
            f"`report.min_se` ({float(cfg['min_se']):.3f}, the spread between CPU kinds) "
            "floors it only where the paired runs trained on different CPUs. A selection claim "
            "whose interval holds 0 is *inconclusive* where oracle − random (the selection "
            "that knows the true skills: the testbed's positive control) does not clear the "
            "minimum detectable difference — the benchmark cannot tell selections apart — and "
            "*not reproduced* where it does. Near full is a non-inferiority test against "
            f"`report.near_full_margin` = {float(cfg['near_full_margin']):.2f} of full's gain "
            "over the base model. The oracle is a reference, never a contender. Results are "
            "findings, not targets.", ""]
    notes = ["Notes:", ""] + [f"- {n}" for n in NOTES] + [""]
    if claims.empty:
        return "\n".join(head + ["(nothing to compare)", ""] + notes)
    main = claims[~claims["claim"].str.endswith("(diagnosis)")]
    diag = claims[claims["claim"].str.endswith("(diagnosis)")]
    return ("\n".join(head) + "\n" + to_markdown(main) + "\n" + "\n".join(notes)
            + "\n## Diagnosis\n\n" + to_markdown(diag))


def plot_comparisons(cmp: pd.DataFrame, dataset: str, cfg: Mapping[str, Any],
                     out_png: str | os.PathLike) -> None:
    """Forest plot, one panel per model of `dataset`: each method's paired difference to
    random at the claim budget with its 95% interval (horizontal bar), 0 (solid) and ±MDE
    (dashed: the panel's power line, oracle − random's minimum detectable difference, or the
    largest MDE among the panel's comparisons without an oracle). A bar inside the dashed
    lines is a difference this design could not have detected reliably. Missing
    comparisons leave a panel that says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = cmp[(cmp["dataset"] == dataset) & (cmp["b"] == RANDOM)] if len(cmp) else cmp
    models = list(dict.fromkeys(d["model"])) if len(d) else []
    fig, axes = plt.subplots(1, max(1, len(models)),
                             figsize=(5 * max(1, len(models)), 1.2 + 0.45 * max(2, len(d))),
                             squeeze=False)
    if not models:
        ax = axes[0][0]
        ax.text(0.5, 0.5, f"{dataset}: no paired comparisons with random", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
    for ax, model in zip(axes[0], models):
        m = d[d["model"] == model].reset_index(drop=True)
        y = np.arange(len(m))[::-1]
        err = np.vstack([m["diff"] - m["ci_low"], m["ci_high"] - m["diff"]])
        ax.errorbar(m["diff"], y, xerr=err, fmt="o", capsize=3, color="C0")
        ora = m[m["a"] == ORACLE]
        mde = float(ora["mde"].iloc[0]) if len(ora) else float(m["mde"].max())
        ax.axvline(0, color="black", lw=0.8)
        for x in (-mde, mde):
            ax.axvline(x, color="gray", ls="--", lw=0.8)
        ax.set_yticks(y, [f"{a} − random" for a in m["a"]], fontsize=8)
        ax.set_xlabel(f"paired difference in average accuracy (95% CI); dashed: ±MDE "
                      f"{mde:.3f}" + ("" if len(ora) else " (no oracle: largest MDE)"),
                      fontsize=8)
        ax.set_title(f"{dataset} / {model}")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    _save(fig, out_png, cfg)


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
               run_dir: str | os.PathLike | None = None,
               sources: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Read every run's result files and write the tables, plots and findings.

    ``clusterings``: {dataset, model, seed, features, clusters, labels} records for the
    skill-recovery table; ``labels``: dataset -> labels.parquet for the per-label counts of
    the selections. With both, the diagnosis tables (skill recovery, label counts) are
    written too. The paired comparisons (from the runs' per-item results; empty without
    them), claims.md and findings.md (the same verdicts, clusterft.analysis.verdict) and one
    forest plot per dataset (`comparisons_<dataset>.png`) always. ``sources``: dataset -> its
    source (config `datasets.<name>.source`), for the claims' scope note per testbed.
    ``run_dir``: the run's folder (its
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
    from clusterft.analysis import verdict

    if clusterings is not None and labels is not None:
        sr = verdict.skill_recovery(clusterings)
        srs = verdict.skill_recovery_summary(sr) if len(sr) else pd.DataFrame(
            columns=["dataset", "model", "features", "ari", "ari_ci"])
        table("skill_recovery", sr, to_markdown(srs) if len(srs) else "(no clusterings)\n")
        lc = verdict.label_counts(df.to_dict("records"), labels)
        ls = verdict.label_summary(lc) if len(lc) else pd.DataFrame(
            columns=["dataset", "model", "method", "budget"])
        table("label_counts", lc, to_markdown(ls) if len(ls) else "(no selections)\n")
        plot_skill_recovery(srs, cfg, pdir / "skill_recovery.png")
        written["plots"].append(str(pdir / "skill_recovery.png"))
    else:
        srs = pd.DataFrame(columns=["dataset", "model", "features", "ari", "ari_ci"])
        ls = pd.DataFrame(columns=["dataset", "model", "method", "budget"])
    # min_se enters only comparisons whose paired runs trained on different CPUs.
    cmp = verdict.comparisons(df, float(cfg["claim_budget"]), float(cfg["min_se"]),
                              int(cfg["n_boot"]))
    table("comparisons", cmp, to_markdown(cmp) if len(cmp) else "(no paired runs)\n")
    # One decider: claims.md and findings.md both show this table's verdicts.
    claims = verdict.claims_table(cmp, tt, srs, ls, cfg, bt, sources)
    write_text(tdir / "claims.md", claims_markdown(claims, cfg))
    write_text(tdir / "findings.md", findings_text(acc, tt, cfg, tasks, df, claims))
    written["tables"] += [str(tdir / "claims.md"), str(tdir / "findings.md")]
    if run_dir is not None:
        from clusterft.analysis.overhead import write_tables

        written["tables"] += write_tables(run_dir, tdir, float(cfg["claim_budget"]),
                                          cells=set(zip(df["dataset"], df["model"])))
    for ds in dict.fromkeys(df["dataset"]):
        p = pdir / f"accuracy_vs_data_{ds}.png"
        plot_accuracy(acc, ds, tasks, task_specs, cfg, p)
        p2 = pdir / f"time_{ds}.png"
        plot_time(tt, ds, cfg, p2)
        p3 = pdir / f"comparisons_{ds}.png"
        plot_comparisons(cmp, ds, cfg, p3)
        written["plots"] += [str(p), str(p2), str(p3)]
    return written
