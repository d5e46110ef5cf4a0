"""Snakemake wrapper: accuracy-vs-data and time tables, plots and findings."""
import pandas as pd

from clusterft.benchmarks import TASKS
from clusterft.io import atomic_path
from clusterft.report import run_report
from clusterft.smk import logged


def record(run, eval_json=None):
    base = "results/{dataset}/{model}/{method}-{budget}/g{gpus}-{dist}/s{seed}".format(**run)
    return {
        **{k: run[k] for k in ("dataset", "model", "method", "budget", "gpus", "seed")},
        "distribution": run["dist"],
        "eval_json": eval_json,
        "train_metrics_json": base.replace("results/", "results/train/", 1)
        + "/train_metrics.json",
    }


with logged(snakemake.log[0]):
    runs = [
        record(r, f"results/eval/{r['dataset']}/{r['model']}/{r['method']}-{r['budget']}"
               f"/g{r['gpus']}-{r['dist']}/s{r['seed']}/results.json")
        for r in snakemake.params.accuracy_runs
    ]
    acc_keys = {tuple(sorted(r.items())) for r in snakemake.params.accuracy_runs}
    runs += [record(r) for r in snakemake.params.time_runs
             if tuple(sorted(r.items())) not in acc_keys]
    runs += [
        {"dataset": d, "model": m, "method": "base", "budget": 0.0, "seed": 0,
         "eval_json": f"results/eval/{d}/{m}/base/results.json"}
        for d in snakemake.params.datasets for m in snakemake.params.models
    ]
    with atomic_path(snakemake.output.runs) as tmp:
        pd.DataFrame(runs).to_csv(tmp, index=False)
    run_report(runs, "results/tables", "results/plots", task_specs=TASKS)
