"""Snakemake wrapper: the score warm-up, once for every shard (score.shards > 1)."""
from clusterft.stages.score import run_score_warmup
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_score_warmup(
        snakemake.input.model,
        snakemake.input.pool,
        snakemake.params.cfg,
        snakemake.output.warmup,
        seed=int(snakemake.wildcards.seed),
        threads=snakemake.threads,
        length_policy=snakemake.params.length_policy,
    )
