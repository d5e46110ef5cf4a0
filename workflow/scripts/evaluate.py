"""Snakemake wrapper: lm-eval on the run's benchmark tasks."""
from clusterft.stages.evaluate import run_evaluate
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_evaluate(
        snakemake.input.model,
        list(snakemake.params.tasks),
        list(snakemake.input.task_items),
        snakemake.params.cfg,
        out_json=snakemake.output.results,
        tasks_dir=snakemake.output.tasks,
        seed=int(getattr(snakemake.wildcards, "seed", 0)),
        out_items=snakemake.output.per_item,
        mirror=snakemake.params.mirror,
    )
