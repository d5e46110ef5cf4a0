"""Snakemake wrapper: the general corpus, disjoint from every pool and benchmark."""
from clusterft.corpus import run_corpus
from clusterft.smk import logged

with logged(snakemake.log[0]):
    run_corpus(
        snakemake.params.cfg,
        snakemake.output[0],
        exclude_paths=list(snakemake.input.pools) + list(snakemake.input.benchmarks),
        seed=snakemake.params.seed,
    )
