"""Snakemake wrapper: budgeted selection (see clusterft.stages.select for the methods)."""
from clusterft.stages.select import run_select
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_select(
        snakemake.input.clusters,
        snakemake.input.scores,
        snakemake.wildcards.method,
        float(snakemake.wildcards.budget),
        snakemake.params.cfg,
        snakemake.output.selection,
        snakemake.output.summary,
        seed=int(snakemake.wildcards.seed),
        labels=getattr(snakemake.input, "labels", None),
        epochs=int(snakemake.params.epochs),
        features=getattr(snakemake.input, "features", None),
        targets=getattr(snakemake.input, "targets", None),
        target_ids=getattr(snakemake.input, "target_ids", None),
    )
