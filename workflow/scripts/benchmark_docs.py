"""Snakemake wrapper: the named lm-eval tasks' test documents and dev items as items."""
from clusterft.stages.data.benchmark_docs import run_benchmark_docs
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    run_benchmark_docs(
        list(snakemake.params.tasks),
        snakemake.output.docs,
        mirror=snakemake.params.mirror,
        seed=snakemake.params.seed,
        confirm_run_unsafe_code=snakemake.params.confirm_run_unsafe_code,
        manifest=next(iter(snakemake.input.manifest), None),
    )
