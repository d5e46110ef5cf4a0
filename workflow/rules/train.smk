# Data-parallel fine-tuning with torch.distributed, launched by torchrun:
# one process per GPU (gloo CPU ranks in the embedded default). A one-GPU run is a plain
# `python -m clusterft.train` process (no launcher, no process group: same model).
# With train.checkpoint_every, checkpoints go to <model>.ckpt/ beside the declared outputs:
# after a killed run, `snakemake --rerun-incomplete` deletes the incomplete outputs and the
# rerun resumes from the checkpoint (tests/test_workflow.py kills one with SIGKILL).


rule train:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
        selection="results/select/{dataset}/{model}/{method}-{budget}/s{seed}/selection.parquet",
    output:
        model=directory(f"results/train/{RUN}/model"),
        metrics=f"results/train/{RUN}/train_metrics.json",
    log:
        f"logs/train/{RUN}.log",
    benchmark:
        f"benchmarks/out/train/{RUN}.tsv"
    conda:
        ENV
    # One core per rank, capped at --cores (--threads shares them among the ranks, so
    # jobs that run side by side do not oversubscribe the cores).
    threads: lambda w: int(w.gpus)
    resources:
        mem_mb=lambda w: 4000 * int(w.gpus),
        runtime=600,
        gpu=lambda w: int(w.gpus) if USE_GPU else 0,
    params:
        launcher=train_launcher,
        cfg=train_cfg,
    shell:
        "{params.launcher} -m clusterft.train"
        " --model {input.model} --pool {input.pool} --selection {input.selection}"
        " --out {output.model} --metrics {output.metrics}"
        " --distribution {wildcards.dist} --seed {wildcards.seed} --threads {threads}"
        " --config {params.cfg:q} > {log} 2>&1"
