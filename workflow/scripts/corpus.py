"""Snakemake wrapper: the general corpus, disjoint from every pool and benchmark."""
from pathlib import Path

from clusterft.stages.data.corpus import run_corpus
from clusterft.pipeline.smk import logged

with logged(snakemake.log[0]):
    bench_files = sorted(str(p) for d in snakemake.input.task_items for p in Path(d).glob("*.jsonl"))
    run_corpus(
        snakemake.params.cfg,
        snakemake.output[0],
        exclude_texts_paths=list(snakemake.input.pools) + bench_files,
        seed=snakemake.params.seed,
    )
