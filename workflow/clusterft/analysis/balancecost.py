"""The cost model of :mod:`clusterft.analysis.costmodel` held against the measured CPU-rank time runs,
and what it predicts for the same token plans on GPUs: ``balance_cost.{csv,md}``.

Every multi-rank train run records, per step and rank, the padded tokens it processed
(``padded_tokens_per_step`` in ``train_metrics.json``). The cost model says a step lasts
as long as its slowest rank, so a run's time is

    wall = seconds_per_token x W + step_overhead x S,   W = sum over steps of max over ranks
                                                            of padded tokens, S = steps

Checked here: the two constants are fitted (non-negative least squares) to the time runs of
one model, rank count and precision (every dataset, method and distribution: their W and S
differ), and the fit's relative residual spread is the noise of one run's wall time. For
each pair of runs that differ only in the distribution, the table gives the measured
balanced / random ratio, the ratio the fitted model predicts from the two runs' own plans,
and whether they agree within the noise (twice the spread of a ratio of two runs). Where
the predicted effect is smaller than that noise, CPU ranks cannot show it, and the table
says so rather than reading a verdict into noise. The last column applies the documented
GPU default (:meth:`CostModel.from_params`, a 7B LoRA on an H100 at the assumed MFU) to the
same plans: what balancing these exact batches would buy on GPUs under that model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from clusterft.analysis.costmodel import KNOWN_PARAMS, CostModel
from clusterft.pipeline.names import BALANCED, RANDOM_SPLIT

__all__ = ["plan_work", "fit_cost", "balance_table", "balance_markdown", "GPU_MODEL"]

GROUP = ["model", "gpus", "epochs", "precision"]
PAIR = ["dataset", "model", "gpus", "method", "budget", "epochs", "precision", "seed"]
# The GPU projection's model: the paper config's 7B LoRA on an H100 at the assumed MFU.
GPU_MODEL = "meta-llama/Llama-2-7b-hf"


def plan_work(padded_tokens_per_step: Any) -> float:
    """W of one run: the sum over steps of the largest rank's padded tokens (NaN without a
    per-step record)."""
    if not padded_tokens_per_step:
        return float("nan")
    return float(sum(max(int(t) for t in np.ravel(step)) for step in padded_tokens_per_step))


def fit_cost(work: np.ndarray, steps: np.ndarray, wall: np.ndarray) -> dict:
    """Non-negative least squares ``wall ~ a * work + b * steps``: a (seconds per padded
    token), b (seconds per step), the relative residual spread (sd of wall / fitted - 1,
    ddof 2) and n. NaN where fewer than 3 runs or the fit is degenerate."""
    from scipy.optimize import nnls

    work, steps, wall = (np.asarray(v, dtype=np.float64) for v in (work, steps, wall))
    ok = np.isfinite(work) & np.isfinite(steps) & np.isfinite(wall) & (wall > 0)
    n = int(ok.sum())
    out = {"seconds_per_token": np.nan, "step_overhead_s": np.nan, "rel_resid_sd": np.nan,
           "n_runs": n}
    if n < 3:
        return out
    X = np.column_stack([work[ok], steps[ok]])
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(X / scale, wall[ok])
    coef = coef / scale
    fitted = X @ coef
    if not np.all(fitted > 0):
        return out
    rel = wall[ok] / fitted - 1.0
    out.update(seconds_per_token=float(coef[0]), step_overhead_s=float(coef[1]),
               rel_resid_sd=float(np.sqrt((rel ** 2).sum() / (n - 2))))
    return out


def _ratio(per_token: float, per_step: float, b: pd.Series, r: pd.Series) -> float:
    """Balanced / random seconds of two runs' plans under one cost model."""
    def seconds(run: pd.Series) -> float:
        return per_token * run["padded_work"] + per_step * run["steps"]

    return seconds(b) / seconds(r)


def balance_table(df: pd.DataFrame, gpu: CostModel | None = None) -> pd.DataFrame:
    """One row per (dataset, model, ranks, method, budget, epochs, precision, seed) with a
    random and a balanced run: measured seconds and ratio, the fitted CPU model's predicted
    ratio and its noise, the verdicts, and the GPU default's predicted ratio.

    ``df``: run rows with gpus, distribution, wall_time_s, steps, padded_work (W), epochs
    and precision (:func:`clusterft.stages.report.load_runs`)."""
    gpu = gpu or CostModel.from_params(KNOWN_PARAMS[GPU_MODEL], "lora")
    cols = PAIR + ["random_s", "balanced_s", "measured_ratio", "predicted_ratio",
                   "ratio_noise", "cpu_can_show", "agrees", "seconds_per_token",
                   "step_overhead_s", "fit_runs", "gpu_predicted_ratio"]
    need = {"wall_time_s", "padded_work", "distribution", "gpus"}
    if not need <= set(df.columns):
        return pd.DataFrame(columns=cols)
    tr = df[df["wall_time_s"].notna() & df["padded_work"].notna()].copy()
    tr = tr[(tr["gpus"].fillna(1).astype(int) > 1)
            & tr["distribution"].isin([RANDOM_SPLIT, BALANCED])]
    if tr.empty:
        return pd.DataFrame(columns=cols)
    tr["gpus"] = tr["gpus"].astype(int)
    tr["epochs"] = tr["epochs"].fillna("-")
    fits = {key: fit_cost(g["padded_work"], g["steps"], g["wall_time_s"])
            for key, g in tr.groupby(GROUP, dropna=False)}
    rows = []
    for key, g in tr.groupby(PAIR, dropna=False):
        by = {d: g[g["distribution"] == d] for d in (RANDOM_SPLIT, BALANCED)}
        if any(len(v) != 1 for v in by.values()):
            continue
        r, b = by[RANDOM_SPLIT].iloc[0], by[BALANCED].iloc[0]
        fit = fits[tuple(key[PAIR.index(k)] for k in GROUP)]
        a, o = fit["seconds_per_token"], fit["step_overhead_s"]
        pred = _ratio(a, o, b, r)
        noise = np.sqrt(2.0) * fit["rel_resid_sd"]
        measured = b["wall_time_s"] / r["wall_time_s"]
        rows.append({
            **dict(zip(PAIR, key)),
            "random_s": r["wall_time_s"], "balanced_s": b["wall_time_s"],
            "measured_ratio": measured, "predicted_ratio": pred, "ratio_noise": noise,
            # the predicted effect stands out of one pair's noise (2 sd)
            "cpu_can_show": bool(np.isfinite(noise) and abs(pred - 1) > 2 * noise),
            "agrees": bool(np.isfinite(noise) and abs(measured - pred) <= 2 * noise),
            "seconds_per_token": a, "step_overhead_s": o, "fit_runs": fit["n_runs"],
            "gpu_predicted_ratio": _ratio(gpu.seconds_per_token, gpu.step_overhead_s, b, r),
        })
    return pd.DataFrame(rows, columns=cols)


def balance_markdown(bt: pd.DataFrame, gpu: CostModel | None = None) -> str:
    """The table with the model, the fit and what the verdict columns mean."""
    from clusterft.analysis.overhead import to_markdown

    gpu = gpu or CostModel.from_params(KNOWN_PARAMS[GPU_MODEL], "lora")
    head = (
        "Cost model (`clusterft.analysis.costmodel`): a step lasts as long as its slowest rank, "
        "wall = s/token x W + s/step x S (W: sum over steps of the largest rank's padded "
        "tokens, S: steps). s/token and s/step are fitted (non-negative least squares) to "
        "the time runs of one model, rank count and precision; `noise`: the spread of a "
        "ratio of two runs (sqrt 2 x the fit's relative residual sd). `cpu can show`: the "
        "predicted balanced/random ratio differs from 1 by more than 2 noise; `agrees`: "
        "measured and predicted ratios differ by at most 2 noise. `GPU ratio`: the same two "
        f"plans under the documented GPU default ({GPU_MODEL} LoRA, "
        f"{gpu.seconds_per_token:.3g} s/token, {gpu.step_overhead_s:g} s/step; assumptions, "
        "not measurements).\n\n")
    if bt.empty:
        return head + "(no pair of multi-rank runs that differ only in the distribution)\n"
    view = pd.DataFrame({
        "dataset": bt["dataset"], "model": bt["model"], "ranks": bt["gpus"],
        "method": [f"{m}-{b:g}" for m, b in zip(bt["method"], bt["budget"])],
        "seed": bt["seed"],
        "random s": bt["random_s"].map(lambda v: f"{v:.2f}"),
        "balanced s": bt["balanced_s"].map(lambda v: f"{v:.2f}"),
        "measured": bt["measured_ratio"].map(lambda v: f"{v:.3f}"),
        "predicted": bt["predicted_ratio"].map(lambda v: f"{v:.3f}"),
        "noise": bt["ratio_noise"].map(lambda v: f"{v:.3f}"),
        "cpu can show": bt["cpu_can_show"].map({True: "yes", False: "no"}),
        "agrees": bt["agrees"].map({True: "yes", False: "no"}),
        "GPU ratio": bt["gpu_predicted_ratio"].map(lambda v: f"{v:.3f}"),
    })
    fits = bt.drop_duplicates(GROUP)
    fit_lines = "".join(
        f"- {r.model}, {r.gpus} ranks ({r.precision}, {r.epochs} epochs): "
        f"{r.seconds_per_token:.3g} s/token, {r.step_overhead_s:.3g} s/step, "
        f"ratio noise {r.ratio_noise:.3f}, from {r.fit_runs} runs\n"
        for r in fits.itertuples())
    return head + to_markdown(view) + "\n\nFits:\n\n" + fit_lines
