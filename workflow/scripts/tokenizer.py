"""Snakemake wrapper: train the byte-level BPE tokenizer (or fetch a hub one)."""
from clusterft.stages.models import run_tokenizer
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_tokenizer(
        snakemake.input.corpus,
        snakemake.params.cfg,
        snakemake.output[0],
        allow_downloads=snakemake.params.allow_downloads,
        download_cfg=snakemake.params.download,
        seed=snakemake.params.seed,
    )
