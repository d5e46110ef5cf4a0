"""Snakemake wrapper: one shard of the score gradient pass (shard 0 also the targets)."""
from clusterft.stages.score import run_score_shard
from clusterft.pipeline.smk import logged
from clusterft.tasks.targets import available

with logged(snakemake.log[0]):
    items, tasks = list(snakemake.input.task_items), list(snakemake.params.tasks)
    run_score_shard(
        snakemake.input.model,
        snakemake.input.pool,
        snakemake.input.warmup,
        snakemake.params.cfg,
        int(snakemake.wildcards.shard),
        snakemake.output.shard,
        seed=int(snakemake.wildcards.seed),
        threads=snakemake.threads,
        targets=(items, tasks) if available(items, tasks) else None,
    )
