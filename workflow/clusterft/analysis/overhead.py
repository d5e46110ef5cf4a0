"""End-to-end cost of the method: (score + cluster + select + train on the budget) over
full-data training, from the wall times Snakemake writes for every job (``benchmark:``).

The method exists to save training time, so its own stages count against it. For each
dataset x model x seed x (GPUs, distribution) of a finished run that trained both the
method's selection (``cluster`` at ``budget``) and the full data with the same GPUs and
distribution, :func:`overhead_table` gives the seconds of each selection stage (the ``score``
job, with ``score.shards`` > 1 plus its warm-up job and slowest shard, the ``cluster``
job on the gradient features, the ``select`` job), the train jobs at the
budget and on the full data, and

    ratio = (score + cluster + select + train at budget) / train on full data

(issue 14 aims at <= 0.36; the budget itself, 0.31, is the limit with free selection).
Warm-up of the base model (its pretraining, ``base_model``) and the data preparation are
shared by every method, full data included, and are excluded. The ``score`` job is counted
whole: besides the method's LoRA warm-up and gradient pass it also writes S2L's loss
trajectories and LESS's target gradients (other methods' inputs), so the overhead is an
upper bound. Times are jobs' wall seconds, start-up included, measured while other jobs
shared the cores (Snakemake runs jobs side by side), so one run's figures are noisy. Where
one job trained all seeds of a run (``sweep.accuracy.fuse_seeds``), each seed counts an even
share of that job's seconds, its start-up shared too; the budget and full-data runs are
fused alike, so their ratio compares like with like.

:func:`project_to_paper` scales the same ratio to the paper's setting (``PAPER``), with
the stated laws: score ~ tokens x params (warm-up, loss passes and gradient pass are all
forward/backward passes over pool tokens), cluster ~ N x k x d x iterations (iterations
as here), select ~ N, train ~ tokens x params x epochs. Training is scaled from its loop
time (``train_metrics.json``'s ``wall_time_s``: per-job start-up vanishes at that scale),
the score job from its seconds less the full train job's fixed part (job seconds - loop
seconds: imports, model load, writes; with fused seeds its share, which makes the estimate
larger), cluster and select from their whole jobs
(start-up scaled too: conservative, and negligible after the scaling). Score and
train are assumed to run on the same kind of device at the same efficiency, the scoring job
on ``score_gpus`` of them and training on ``train_gpus`` (the workflow's score job uses one
device). Pool size cancels under these laws (every stage is linear in it).

    python -m clusterft.analysis.overhead WORKDIR [--budget 0.31]   (tables of a finished run)
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from clusterft.pipeline.errors import InputError

TARGET = 0.36
KEYS = ["dataset", "model", "seed", "gpus", "distribution"]

# The paper's setting (config/paper.yaml: Llama-2 7B and 13B, LoRA, 4 epochs, 8 GPUs,
# projection dim 8192, k = 64). The embedded models map to the paper's by size order
# (smallest -> 7B). tokens_per_example is an assumption (instruction pools of a few hundred
# tokens); it only enters the cluster and select terms, which do not grow with tokens.
PAPER: dict[str, Any] = {
    "params": [6.74e9, 13.0e9],
    "epochs": 4,
    "k": 64,
    "dim": 8192,
    "tokens_per_example": 300,
    "train_gpus": 8,
    "score_gpus": 1,
}


# ----------------------------------------------------------------------------- reading
def _seconds(tsv: Path) -> float:
    """The job's wall seconds: column ``s`` of the last line of a benchmark tsv."""
    try:
        df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise InputError(f"not a Snakemake benchmark file ({e})", path=str(tsv)) from None
    if "s" not in df or df.empty:
        raise InputError("benchmark file has no row with column 's'", path=str(tsv), field="s")
    s = pd.to_numeric(df["s"], errors="coerce").iloc[-1]
    if not np.isfinite(s) or s < 0:
        raise InputError(f"seconds must be a number >= 0, got {df['s'].iloc[-1]!r}",
                         path=str(tsv), field="s")
    return float(s)


def _method_budget(part: str) -> tuple[str, float]:
    method, _, budget = part.rpartition("-")
    return method, float(budget)


def parse_benchmark_path(rel: Path) -> dict | None:
    """Keys of a ``benchmarks/out`` file of the selection and train rules (None: another
    rule's). ``rel`` is relative to ``benchmarks/out``."""
    p = rel.with_suffix("").parts
    try:
        if p[0] in ("score", "score_warmup") and len(p) == 4:
            return {"rule": p[0], "dataset": p[1], "model": p[2], "seed": int(p[3][1:])}
        if p[0] == "score_shard" and len(p) == 5:
            return {"rule": p[0], "dataset": p[1], "model": p[2], "seed": int(p[3][1:]),
                    "kind": p[4]}
        if p[0] == "cluster" and len(p) == 5:
            return {"rule": "cluster", "dataset": p[1], "model": p[2], "kind": p[3],
                    "seed": int(p[4][1:])}
        if p[0] == "select" and len(p) == 5:
            m, b = _method_budget(p[3])
            return {"rule": "select", "dataset": p[1], "model": p[2], "method": m,
                    "budget": b, "seed": int(p[4][1:])}
        if p[0] == "train" and len(p) == 6:
            m, b = _method_budget(p[3])
            gpus, _, dist = p[4].partition("-")
            seeds = [int(s) for s in p[5][1:].split("+")]
            keys = {"rule": "train", "dataset": p[1], "model": p[2], "method": m, "budget": b,
                    "gpus": int(gpus[1:]), "distribution": dist, "seed": seeds[0]}
            if len(seeds) > 1:  # one job trained these seeds (sweep.accuracy.fuse_seeds)
                keys["seeds"] = seeds
            return keys
    except ValueError:
        raise InputError("benchmark path does not follow the workflow's layout "
                         "(score/D/M/sS, cluster/D/M/KIND/sS, select/D/M/METHOD-BUDGET/sS, "
                         "train/D/M/METHOD-BUDGET/gG-DIST/sS or sS+S+...)",
                         path=str(rel)) from None
    return None


def read_benchmarks(bench_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per score/cluster/select/train benchmark file under ``bench_dir``
    (``benchmarks/out`` of a run): its keys, ``s`` and ``path``. A train job of several
    seeds (``sweep.accuracy.fuse_seeds``: ``.../sS+S+....tsv``) gives one row per seed with
    an even share of its seconds (``job_seeds``: how many shared them)."""
    root = Path(bench_dir)
    if not root.is_dir():
        raise InputError("benchmark folder does not exist", path=str(root))
    rows = []
    for tsv in sorted(root.rglob("*.tsv")):
        keys = parse_benchmark_path(tsv.relative_to(root))
        if keys is None:
            continue
        seeds = keys.pop("seeds", [keys.get("seed")])
        s = _seconds(tsv)
        for seed in seeds:  # a job of several seeds: its seconds shared evenly among them
            rows.append({**keys, "seed": seed, "s": s / len(seeds), "job_seeds": len(seeds),
                         "path": str(tsv)})
    cols = ["rule", "dataset", "model", "kind", "method", "budget", "gpus", "distribution",
            "seed", "s", "job_seeds", "path"]
    return pd.DataFrame(rows, columns=cols)


# ----------------------------------------------------------------------------- table
def _one(df: pd.DataFrame, what: str, **keys: Any) -> pd.Series:
    m = np.ones(len(df), dtype=bool)
    for k, v in keys.items():
        m &= (np.isclose(df[k].astype(float), v) if isinstance(v, float)
              else (df[k] == v).to_numpy())
    hit = df[m]
    if hit.empty:
        raise InputError(f"no {what} benchmark file for "
                         + ", ".join(f"{k}={v}" for k, v in keys.items())
                         + " (the run is unfinished, or was not made by this workflow)")
    return hit.iloc[0]


def _score_seconds(bench: pd.DataFrame, score: pd.Series, base: Mapping[str, Any]) -> float:
    """The score stage's wall seconds: the score job, plus with ``score.shards`` > 1 the
    warm-up job and the slowest shard (the shards run side by side, one device each)."""
    s = float(score["s"])
    for rule, agg in (("score_warmup", "sum"), ("score_shard", "max")):
        part = bench[(bench["rule"] == rule) & (bench["dataset"] == base["dataset"])
                     & (bench["model"] == base["model"]) & (bench["seed"] == base["seed"])]
        if len(part):
            s += float(part["s"].agg(agg))
    return s


def overhead_table(bench: pd.DataFrame, method: str = "cluster", budget: float = 0.31,
                   kind: str = "gradient", full: str = "full") -> pd.DataFrame:
    """Per dataset x model x seed x gpus x distribution with both a ``method`` run at
    ``budget`` and a ``full`` run: seconds by stage and the ratios (module docstring).
    A train run whose score, cluster or select file is missing raises InputError."""
    tr = bench[bench["rule"] == "train"]
    sub = tr[(tr["method"] == method) & np.isclose(tr["budget"].astype(float), budget)]
    rows = []
    for _, r in sub.iterrows():
        key = {k: r[k] for k in KEYS}
        ref = tr[(tr["method"] == full) & (tr["dataset"] == r["dataset"])
                 & (tr["model"] == r["model"]) & (tr["seed"] == r["seed"])
                 & (tr["gpus"] == r["gpus"]) & (tr["distribution"] == r["distribution"])]
        if ref.empty:
            continue
        base = {"dataset": r["dataset"], "model": r["model"], "seed": r["seed"]}
        sc = _one(bench[bench["rule"] == "score"], "score", **base)
        score_s = _score_seconds(bench, sc, base)
        cl = _one(bench[bench["rule"] == "cluster"], "cluster", **base, kind=kind)
        se = _one(bench[bench["rule"] == "select"], "select", **base, method=method,
                  budget=float(budget))
        over = score_s + cl["s"] + se["s"]
        f = float(ref.iloc[0]["s"])
        if f <= 0:
            raise InputError("full-data train job took 0 s", path=ref.iloc[0]["path"], field="s")
        rows.append({**key, "method": method, "budget": float(budget), "score_s": score_s, "cluster_s": cl["s"],
                     "select_s": se["s"], "overhead_s": over, "train_budget_s": r["s"],
                     "train_full_s": f, "overhead_ratio": over / f, "train_ratio": r["s"] / f,
                     "ratio": (over + r["s"]) / f, "target": TARGET,
                     "train_budget_path": r["path"], "train_full_path": ref.iloc[0]["path"]})
    cols = KEYS + ["method", "budget", "score_s", "cluster_s", "select_s", "overhead_s",
                   "train_budget_s", "train_full_s", "overhead_ratio", "train_ratio", "ratio",
                   "target", "train_budget_path", "train_full_path"]
    out = pd.DataFrame(rows, columns=cols).astype({"seed": int, "gpus": int})
    return out.sort_values(KEYS, kind="stable").reset_index(drop=True)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per dataset x model x gpus x distribution (n_seeds, min/max ratio)."""
    if table.empty:
        return table
    g = table.groupby(["dataset", "model", "gpus", "distribution"], sort=False)
    num = ["score_s", "cluster_s", "select_s", "overhead_s", "train_budget_s", "train_full_s",
           "overhead_ratio", "train_ratio", "ratio"]
    out = g[num].mean()
    out.insert(0, "n_seeds", g.size())
    out["ratio_min"], out["ratio_max"] = g["ratio"].min(), g["ratio"].max()
    return out.reset_index()


# ----------------------------------------------------------------------------- paper scale
def safetensors_params(path: str | os.PathLike) -> int:
    """Parameter count of a ``model.safetensors`` file, from its header alone."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the safetensors header ({e})", path=str(p)) from None
    return int(sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"))


def model_params(model_dir: str | os.PathLike) -> int:
    """Parameter count of an HF model folder's weights (every ``*.safetensors`` shard)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights to count the parameters of",
                         path=str(model_dir))
    return sum(safetensors_params(f) for f in files)


def embedded_scale(results: str | os.PathLike, row: Mapping[str, Any], kind: str = "gradient",
                   full: str = "full") -> dict:
    """What the projection needs from a finished run's result files for one table row:
    params (the base model), the full run's and the budget run's loop seconds, epochs,
    examples and tokens per example, and the clustering's N, k, d."""
    from clusterft.pipeline.io import read_json

    res = Path(results)
    d, m, s = row["dataset"], row["model"], int(row["seed"])
    run = f"g{int(row['gpus'])}-{row['distribution']}/s{s}"
    metrics = {}
    for name, part in (("full", f"{full}-1"), ("budget", f"{row['method']}-{row['budget']:g}")):
        path = res / "train" / d / m / part / run / "train_metrics.json"
        mt = read_json(path)
        for f in ("wall_time_s", "tokens", "examples", "epochs"):
            if f not in mt:
                raise InputError("missing field in train metrics", path=str(path), field=f)
        metrics[name] = mt
    feats = res / "score" / d / m / f"s{s}" / "features.npy"
    clusters = res / "cluster" / d / m / kind / f"s{s}" / "clusters.parquet"
    try:
        n, dim = np.load(feats, mmap_mode="r").shape
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the features ({e})", path=str(feats)) from None
    k = int(pd.read_parquet(clusters, columns=["cluster"])["cluster"].nunique())
    fm = metrics["full"]
    return {"params": model_params(res / "models" / m / "base"),
            "loop_full_s": float(fm["wall_time_s"]),
            "loop_budget_s": float(metrics["budget"]["wall_time_s"]),
            "epochs": int(fm["epochs"]), "n": int(n), "k": k, "dim": int(dim),
            "tokens_per_example": float(fm["tokens"]) / (int(fm["examples"]) * int(fm["epochs"]))}


def project_row(row: Mapping[str, Any], emb: Mapping[str, Any], paper_params: float,
                paper: Mapping[str, Any] = PAPER) -> dict:
    """One row's ratio at the paper's scale (module docstring): each stage's embedded
    seconds times its scale law, over the full run's loop seconds times train's."""
    r_tok = float(paper["tokens_per_example"]) / emb["tokens_per_example"]  # per example
    r_par = paper_params / emb["params"]
    r_ep = float(paper["epochs"]) / emb["epochs"]
    r_kd = float(paper["k"]) * float(paper["dim"]) / (emb["k"] * emb["dim"])
    # All per pool example (N cancels); embedded train ran on row['gpus'] ranks.
    g_train = float(paper["train_gpus"]) / int(row["gpus"])
    train_full = emb["loop_full_s"] * r_tok * r_par * r_ep / g_train
    train_budget = emb["loop_budget_s"] * r_tok * r_par * r_ep / g_train
    # The score job's own start-up, model load and writes do not grow with the pool: take
    # the full train job's (job seconds - loop seconds) as their estimate and scale the rest.
    fixed = max(float(row["train_full_s"]) - emb["loop_full_s"], 0.0)
    score_var = max(float(row["score_s"]) - fixed, 0.0)
    score = score_var * r_tok * r_par / float(paper["score_gpus"])
    score_parallel = score_var * r_tok * r_par / float(paper["train_gpus"])
    cluster = row["cluster_s"] * r_kd
    select = row["select_s"]
    return {"paper_params": paper_params, "job_fixed_s": fixed,
            "scale_tokens_x_params": r_tok * r_par,
            "scale_epochs": r_ep, "scale_k_x_d": r_kd,
            "paper_score_share": score / train_full, "paper_cluster_share": cluster / train_full,
            "paper_train_ratio": train_budget / train_full,
            "paper_ratio": (score + cluster + select + train_budget) / train_full,
            "paper_ratio_score_on_all_gpus":
                (score_parallel + cluster + select + train_budget) / train_full}


def project_to_paper(table: pd.DataFrame, results: str | os.PathLike,
                     paper: Mapping[str, Any] = PAPER, kind: str = "gradient") -> pd.DataFrame:
    """``table`` (rows with gpus == 1 only: the multi-rank rows of a CPU run are simulated
    ranks on shared cores) with the embedded scale and the paper-scale columns."""
    rows = []
    t = table[table["gpus"] == 1]
    if t.empty:
        return pd.DataFrame(columns=list(table.columns))
    emb = {(r["dataset"], r["model"], r["seed"]): embedded_scale(results, r, kind)
           for _, r in t.iterrows()}
    models = sorted({m for _, m, _ in emb}, key=lambda m: min(
        e["params"] for (_, mm, _), e in emb.items() if mm == m))
    sizes = list(paper["params"])
    for _, r in t.iterrows():
        e = emb[(r["dataset"], r["model"], r["seed"])]
        i = models.index(r["model"])
        out = {**r.to_dict(), **{f"embedded_{k}": v for k, v in e.items()}}
        if i < len(sizes):
            out.update(project_row(r, e, float(sizes[i]), paper))
        rows.append(out)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- output
NOTE = (
    "ratio = (score + cluster + select + train at the budget) / train on the full data, "
    "from each job's wall seconds (benchmarks/out/<rule>/...tsv). Base-model pretraining and "
    "data preparation are shared by every method and excluded. The score job also writes "
    "S2L's loss trajectories and LESS's target gradients, so the overhead is an upper "
    "bound; jobs ran side by side on shared cores, so the seconds are noisy. Target <= "
    f"{TARGET}; the budget is the limit with free selection. paper_ratio: the same ratio "
    "scaled to the paper's setting (score ~ tokens x params, cluster ~ N x k x d x "
    "iterations, select ~ N, train ~ tokens x params x epochs, train from its loop time, "
    "score from its job less the train job's fixed start-up (job_fixed_s); "
    "score on {score_gpus} GPU and train on {train_gpus}, same device efficiency; "
    "paper_ratio_score_on_all_gpus: scoring spread over the training GPUs; k-means is "
    "assumed to keep its speed relative to the other stages, which it does not if it stays "
    "on a CPU while the rest moves to GPUs).")


def write_tables(run_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 budget: float = 0.31, method: str = "cluster",
                 cells: set[tuple[str, str]] | None = None) -> list[str]:
    """selection_overhead.{csv,md} (every row; the md: means over seeds and the paper
    projection) from a finished run's folder (``benchmarks/out`` and ``results``);
    ``cells``: only these (dataset, model) pairs (a report of part of the run, such as the
    quick target's, leaves out what other targets left in the folder)."""
    from clusterft.pipeline.io import atomic_path, write_text

    run = Path(run_dir)
    table = overhead_table(read_benchmarks(run / "benchmarks" / "out"), method, budget)
    # projected from the whole run (which paper model a local model stands for is decided
    # by ranking every model of the run), then cut to the cells asked for
    proj = project_to_paper(table, run / "results")
    if cells is not None:
        def mine(t: pd.DataFrame) -> pd.DataFrame:
            if not len(t):
                return t
            keep = [(d, m) in cells for d, m in zip(t["dataset"], t["model"])]
            return t[keep].reset_index(drop=True)

        table, proj = mine(table), mine(proj)
    full = table.merge(proj[[c for c in proj.columns if c not in table.columns or c in KEYS]],
                       on=KEYS, how="left") if len(proj) else table
    out = Path(out_dir)
    with atomic_path(out / "selection_overhead.csv") as tmp:
        full.drop(columns=["train_budget_path", "train_full_path"]).to_csv(tmp, index=False)
    write_text(out / "selection_overhead.md", markdown(table, proj))
    return [str(out / "selection_overhead.csv"), str(out / "selection_overhead.md")]


def to_markdown(df: pd.DataFrame, digits: int = 3) -> str:
    """A pipe table (floats to ``digits`` places, integers as they are)."""
    def cell(v: Any) -> str:
        if isinstance(v, (float, np.floating)):
            return "" if np.isnan(v) else f"{v:.{digits}f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(map(str, df.columns)) + " |",
             "|" + "|".join(" --- " for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |"
              for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def markdown(table: pd.DataFrame, proj: pd.DataFrame) -> str:
    """The md table: means over seeds, the note, and the paper projection."""
    if table.empty:
        return "(no run with both the method's selection and the full data)\n"
    s = summary(table)
    text = ("## Selection overhead (embedded run)\n\n"
            + to_markdown(s, digits=3) + "\n"
            + NOTE.format(**PAPER) + "\n")
    if len(proj) and "paper_ratio" in proj:
        cols = ["dataset", "model", "paper_params", "embedded_params", "scale_tokens_x_params",
                "scale_epochs", "scale_k_x_d", "paper_score_share", "paper_cluster_share",
                "paper_train_ratio", "paper_ratio", "paper_ratio_score_on_all_gpus"]
        p = proj.groupby(["dataset", "model"], sort=False)[cols[2:]].mean().reset_index()
        for c in ("paper_params", "embedded_params"):
            p[c] = p[c].map(lambda v: f"{v:.3g}")
        text += ("\n## Projected to the paper's scale\n\n"
                 + f"Paper setting: {json.dumps(PAPER)}; means over seeds of 1-GPU rows.\n\n"
                 + to_markdown(p, digits=3) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("workdir", type=Path, help="the workflow's working directory (holds results/)")
    ap.add_argument("--budget", type=float, default=0.31, help="the method's budget (default 0.31)")
    ap.add_argument("--method", default="cluster", help="the selection method to cost (default cluster)")
    ap.add_argument("--out", type=Path, default=None, help="write selection_overhead.* here")
    a = ap.parse_args(argv)
    table = overhead_table(read_benchmarks(a.workdir / "benchmarks" / "out"), a.method,
                           a.budget)
    proj = project_to_paper(table, a.workdir / "results")
    print(markdown(table, proj))
    if a.out is not None:
        print("\n".join(write_tables(a.workdir, a.out, a.budget, a.method)))


if __name__ == "__main__":
    main()
