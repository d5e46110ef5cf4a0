"""Snakemake wrapper: cosine k-means of one feature kind."""
from clusterft.stages.cluster import run_cluster
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_cluster(
        snakemake.input.features,
        snakemake.input.scores,
        snakemake.params.cfg,
        snakemake.output.clusters,
        snakemake.output.centroids,
        seed=int(snakemake.wildcards.seed),
    )
