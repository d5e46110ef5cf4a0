"""Snakemake wrapper: per-example gradient features and scores."""
from clusterft.score import run_score
from clusterft.smk import logged

with logged(snakemake.log[0]):
    run_score(
        snakemake.input.model,
        snakemake.input.pool,
        snakemake.params.cfg,
        snakemake.output.features,
        snakemake.output.scores,
        seed=int(snakemake.wildcards.seed),
        threads=snakemake.threads,
        length_policy=snakemake.params.length_policy,
    )
