"""Per-rule wall times of a finished run, from Snakemake's `benchmark:` files, and what each
part of the study costs.

    python benchmarks/rule_times.py [WORKDIR] [--config CONFIG]

Prints, per rule, the number of jobs and the total / mean / max seconds (and max RSS). With
`--config` (the run's config file), also the job seconds per PART of the study: the shared
inputs, each base model, and per dataset x model cell the paper protocol's runs
(sweep.methods at sweep.budgets, with the method's score and clusters), the baselines with
the feature kinds only they and the skill-recovery table read, the budget curve, the
distribution ablation, the step-matched arm and the time sweep: what dropping a part would
save, measured (a job-second sum; the wall time it saves on 2 cores is about half of it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

SHARED = {"prepare_data", "decontaminate", "contamination_table", "corpus", "tokenizer",
          "benchmark_docs", "download", "report", "quick_report"}


def read_benchmarks(workdir: Path) -> pd.DataFrame:
    """One row per benchmark file: rule, the path below the rule, seconds, max RSS."""
    rows = []
    root = workdir / "benchmarks" / "out"
    for tsv in sorted(root.rglob("*.tsv")):
        parts = tsv.relative_to(root).parts
        df = pd.read_csv(tsv, sep="\t")
        rows.append({"rule": parts[0].removesuffix(".tsv"),
                     "path": "/".join(parts[1:]).removesuffix(".tsv"),
                     "s": float(df["s"].iloc[-1]),
                     "max_rss_mb": float(pd.to_numeric(df["max_rss"], errors="coerce").iloc[-1])})
    return pd.DataFrame(rows, columns=["rule", "path", "s", "max_rss_mb"])


def rule_times(workdir: Path) -> pd.DataFrame:
    t = read_benchmarks(workdir)
    out = t.groupby("rule").agg(jobs=("s", "size"), total_s=("s", "sum"), mean_s=("s", "mean"),
                                max_s=("s", "max"), max_rss_mb=("max_rss_mb", "max"))
    return out.sort_values("total_s", ascending=False).round(1)


def run_group(plan, run: dict) -> str:
    """The part of the study a run (or, for select, a selection) belongs to, from the
    sweep itself (clusterft.plan.sweep.Sweep): the step-matched arm, the distribution
    ablation, a time-only run, the budget curve, the baselines, else the paper protocol."""
    from clusterft.pipeline.names import FULL

    sweep = plan.cfg["sweep"]
    if plan.is_accuracy(run):
        role = plan.run_role(run, True)
        if role == "step_matched":
            return "step-matched arm"
        if role == "ablation":
            return "distribution ablation"
    elif any(plan.key(run) == plan.key(t) for t in plan.time_runs):
        return "time sweep"
    if run["method"] != FULL and float(run["budget"]) not in [float(b) for b in sweep["budgets"]]:
        return "budget curve"
    if run["method"] not in sweep["methods"]:
        return "baselines and skill recovery (other feature kinds)"
    return "paper protocol"


def part_of(rule: str, path: str, plan) -> str:
    """The part of the study a job serves (see the module docstring), from its benchmark
    path (workflow/rules/*.smk): <dataset>/<model>/... for a cell's jobs, then
    <method>-<budget>/g<gpus>-<dist>/s<seeds> for a run's train and evaluate jobs,
    <method>-<budget>/s<seed> for a selection, <kind>/s<seed> for features and clusters,
    base[/shards/...] for the base model's evaluation."""
    from clusterft.pipeline.names import GRADIENT

    if rule in SHARED:
        return "shared: data, corpus, tokenizer, report"
    bits = path.split("/")
    if rule == "base_model":
        return f"base model {bits[0]}"
    cell = "/".join(bits[:2])
    if len(bits) >= 3 and bits[2] == "base":  # evaluate[_shard]/<dataset>/<model>/base...
        return f"{cell}: base model's evaluation"
    if rule.startswith("score"):
        return f"{cell}: paper protocol"  # the method's gradients (S2L's losses ride along)
    if rule in ("cluster", "features"):
        return (f"{cell}: paper protocol" if bits[2] == GRADIENT
                else f"{cell}: baselines and skill recovery (other feature kinds)")
    method, budget = bits[2].rsplit("-", 1)
    run = {"dataset": bits[0], "model": bits[1], "method": method, "budget": budget}
    if rule == "select":  # a selection serves the runs that read it; the main one decides
        acc = plan.cfg["sweep"]["accuracy"]
        run.update(gpus=acc["gpus"], dist=acc["distribution"], seed=bits[3][1:])
    else:
        g, dist = bits[3].split("-", 1)
        run.update(gpus=int(g[1:]), dist=dist, seed=bits[4][1:].split("+")[0])
    return f"{cell}: {run_group(plan, run)}"


def part_times(workdir: Path, cfg: dict) -> pd.DataFrame:
    from clusterft.plan.sweep import Sweep

    plan = Sweep(cfg)
    t = read_benchmarks(workdir)
    t["part"] = [part_of(r, p, plan) for r, p in zip(t["rule"], t["path"])]
    out = t.groupby("part").agg(jobs=("s", "size"), total_s=("s", "sum"))
    out["share"] = out["total_s"] / out["total_s"].sum()
    return out.sort_values("total_s", ascending=False).round(3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", nargs="?", default=".")
    ap.add_argument("--config", help="the run's config file: also print the cost per part")
    args = ap.parse_args(argv)
    wd = Path(args.workdir)
    table = rule_times(wd)
    print(table.to_string())
    print(f"\nsum of job times: {table['total_s'].sum():.0f} s")
    if args.config:
        import yaml

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
        from clusterft.plan.config import settings

        cfg = settings(yaml.safe_load(Path(args.config).read_text()))
        print()
        print(part_times(wd, cfg).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
