"""Snakemake wrapper: lm-eval on the run's benchmark tasks, for each seed's model in turn."""
from clusterft.stages.evaluate import run_evaluate_many
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_evaluate_many(
        list(snakemake.input.model),
        list(snakemake.params.tasks),
        list(snakemake.input.task_items),
        snakemake.params.cfg,
        out_json=list(snakemake.output.results),
        tasks_dir=list(snakemake.output.tasks),
        seeds=[int(s) for s in snakemake.params.seeds],
        out_items=list(snakemake.output.per_item),
        mirror=snakemake.params.mirror,
    )
