"""Snakemake wrapper: gather the per-pool overlap counts into one table."""
from clusterft.stages.data.decontaminate import run_table
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_table(list(snakemake.input), snakemake.output[0])
