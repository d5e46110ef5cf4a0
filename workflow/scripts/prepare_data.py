"""Snakemake wrapper: build one dataset's pool, labels and benchmark items."""
from clusterft.stages.data.prepare import run_prepare_data
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_prepare_data(
        snakemake.wildcards.dataset,
        snakemake.params.cfg,
        out_pool=snakemake.output.pool,
        out_labels=snakemake.output.labels,
        out_items_dir=snakemake.output.task_items,
        out_summary=snakemake.output.summary,
        seed=snakemake.params.seed,
        mirror=snakemake.params.mirror,
    )
