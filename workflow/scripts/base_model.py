"""Snakemake wrapper: build + pretrain a base model (or resolve a hub id / local path)."""
from clusterft.models import run_base_model
from clusterft.smk import logged

with logged(snakemake.log[0]):
    run_base_model(
        snakemake.input.tokenizer,
        snakemake.input.corpus,
        snakemake.params.cfg,
        snakemake.output[0],
        allow_downloads=snakemake.params.allow_downloads,
        seed=snakemake.params.seed,
        threads=snakemake.threads,
    )
