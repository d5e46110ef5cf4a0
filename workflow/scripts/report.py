"""Snakemake wrapper: accuracy-vs-data and time tables, plots and findings."""
from pathlib import Path

import pandas as pd

from clusterft.tasks.registry import TASKS
from clusterft.pipeline.io import atomic_path
from clusterft.stages.report import run_report
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    runs = list(snakemake.params.runs)
    with atomic_path(snakemake.output.runs) as tmp:
        pd.DataFrame(runs).to_csv(tmp, index=False)
    run_report(
        runs,
        Path(snakemake.output.findings).parent,
        # the report rule's plots lie beside its skill plot; quick_report's plots are a folder
        Path(snakemake.output.skill_plot).parent if "skill_plot" in snakemake.output.keys()
        else Path(snakemake.output.plots),
        task_specs=TASKS,
        cfg=snakemake.params.cfg,
        clusterings=list(snakemake.params.clusterings),
        labels=dict(snakemake.params.labels),
        run_dir=".",
        # dataset -> source, for the claims' scope note of each testbed (clusterft.analysis.verdict)
        sources={d: (c or {}).get("source", d)
                 for d, c in (snakemake.config.get("datasets") or {}).items()},
    )
