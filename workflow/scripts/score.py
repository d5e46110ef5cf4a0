"""Snakemake wrapper: per-example gradient features, scores, loss trajectories and the
validation examples' features (LESS's targets; empty where the tasks have none). With
score.shards > 1 the warm-up and shards are inputs, and this merges them."""
from clusterft.stages.score import run_score, run_score_merge
from clusterft.pipeline.smk import logged
from clusterft.tasks.targets import available

with logged(snakemake.log[0]):
    items, tasks = list(snakemake.input.task_items), list(snakemake.params.tasks)
    targets = (items, tasks) if available(items, tasks) else None
    if "shards" in snakemake.input.keys():
        run_score_merge(
            snakemake.input.model,
            snakemake.input.pool,
            snakemake.input.warmup,
            list(snakemake.input.shards),
            snakemake.params.cfg,
            snakemake.output.features,
            snakemake.output.scores,
            seed=int(snakemake.wildcards.seed),
            out_trajectories=snakemake.output.trajectories,
            targets=targets,
            out_targets=snakemake.output.targets,
            out_target_ids=snakemake.output.target_ids,
        )
    else:
        run_score(
            snakemake.input.model,
            snakemake.input.pool,
            snakemake.params.cfg,
            snakemake.output.features,
            snakemake.output.scores,
            seed=int(snakemake.wildcards.seed),
            threads=snakemake.threads,
            length_policy=snakemake.params.length_policy,
            out_trajectories=snakemake.output.trajectories,
            targets=targets,
            out_targets=snakemake.output.targets,
            out_target_ids=snakemake.output.target_ids,
        )
