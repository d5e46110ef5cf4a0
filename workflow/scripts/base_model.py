"""Snakemake wrapper: build + pretrain a base model (or resolve a hub id / local path)."""
from clusterft.stages.models import run_model
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_model(
        snakemake.input.tokenizer,
        snakemake.input.corpus,
        snakemake.params.cfg,
        snakemake.output[0],
        seed=snakemake.params.seed,
        name=snakemake.wildcards.model,
        allow_downloads=snakemake.params.allow_downloads,
        download_cfg=snakemake.params.download,
        threads=snakemake.threads,
    )
