"""Snakemake wrapper: fetch models, hub datasets and lm-eval data into the cache and mirror."""
from clusterft.stages.download import run_download
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_download(
        snakemake.params.cfg,
        out_manifest=snakemake.output.manifest,
        out_mirror=snakemake.output.mirror,
    )
