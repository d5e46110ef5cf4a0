"""Snakemake wrapper: check one pool against every benchmark task; drop or flag overlaps."""
from clusterft.decontaminate import run_decontaminate
from clusterft.smk import logged

with logged(snakemake.log[0]):
    run_decontaminate(
        snakemake.wildcards.dataset,
        snakemake.input.pool,
        list(snakemake.input.benchmarks),
        snakemake.params.cfg,
        out_pool=snakemake.output.pool,
        out_counts=snakemake.output.counts,
    )
