"""Snakemake wrapper: budgeted selection (full, random or per-cluster quotas)."""
from clusterft.select import run_select
from clusterft.smk import logged

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
    )
