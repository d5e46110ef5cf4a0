"""Snakemake wrapper: merge a run's evaluation shards (evaluate.shards > 1) into the
outputs one evaluate job writes."""
from clusterft.stages.evaluate import merge_shards
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    merge_shards(
        list(snakemake.input.shards),
        list(snakemake.params.tasks),
        list(snakemake.input.task_items),
        snakemake.params.cfg,
        out_json=snakemake.output.results,
        tasks_dir=snakemake.output.tasks,
        seed=int(getattr(snakemake.wildcards, "seed", 0)),
        out_items=snakemake.output.per_item,
    )
