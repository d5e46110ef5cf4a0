"""Snakemake wrapper: embedding (with the validation examples', where the tasks have them)
or TF-IDF features in score's format."""
from clusterft.stages.features.representations import run_features
from clusterft.pipeline.smk import logged
from clusterft.tasks.targets import available

with logged(snakemake.log[0]):
    out = snakemake.output
    items, tasks = list(getattr(snakemake.input, "task_items", [])), list(snakemake.params.tasks)
    has_targets = "targets" in out.keys()
    run_features(
        "embedding" if has_targets else "tfidf",
        snakemake.input.pool,
        out.features,
        out.scores,
        cfg=snakemake.params.cfg,
        seed=int(snakemake.wildcards.seed),
        model_dir=getattr(snakemake.input, "model", None),
        threads=snakemake.threads,
        targets=(items, tasks) if has_targets and available(items, tasks) else None,
        out_targets=out.targets if has_targets else None,
        out_target_ids=out.target_ids if has_targets else None,
    )
