"""Snakemake wrapper: accuracy-vs-data and time tables, plots and findings."""
from clusterft.report import run_report
from clusterft.smk import logged

with logged(snakemake.log[0]):
    run_report(
        accuracy_runs=snakemake.params.accuracy_runs,
        time_runs=snakemake.params.time_runs,
        datasets=snakemake.params.datasets,
        tasks=snakemake.params.tasks,
        tables_dir="results/tables",
        plots_dir="results/plots",
        results_dir="results",
    )
