# Data-parallel fine-tuning with torch.distributed, launched by torchrun:
# one process per GPU (gloo CPU ranks in the embedded default). A one-GPU run is a plain
# `python -m clusterft.stages.train` process (no launcher, no process group: same model).
# With train.gpus_per_node below the job's GPU count, the job spans gpus / gpus_per_node
# SLURM nodes: srun starts one torchrun agent per node, meeting at a c10d rendezvous on the
# allocation's first node (clusterft.pipeline.launch; `snakemake -n -p` prints the command). threads,
# mem_mb and the GPU request are then per node.
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
    # the longest runs first (JOBS.train_priority: a share of full data's steps)
    priority: JOBS.train_priority
    conda:
        ENV
    # One core per rank on each node, capped at --cores (--threads shares them among the
    # node's ranks, so jobs that run side by side do not oversubscribe the cores).
    threads: lambda w: JOBS.train_job(w)["ranks_per_node"]
    resources:
        mem_mb=JOBS.memory("train", 4000),
        runtime=JOBS.runtime("train", 600),
        gpu=lambda w: JOBS.train_job(w)["gpu"],
        # several nodes: sbatch --nodes, one task per node, the job's own srun ("mpi", so
        # Snakemake's SLURM job step runs the command as it is), GPUs per node; unset else
        nodes=lambda w: JOBS.train_job(w)["nodes"],
        tasks=lambda w: JOBS.train_job(w)["tasks"],
        mpi=lambda w: JOBS.train_job(w)["mpi"],
        gres=lambda w: JOBS.train_job(w)["gres"],
        tasks_per_gpu=lambda w: JOBS.train_job(w)["tasks_per_gpu"],
    params:
        launcher=JOBS.train_launcher,
        cfg=JOBS.train_cfg,
        distribution=distribution_of,
    shell:
        "{params.launcher} -m clusterft.stages.train"
        " --model {input.model} --pool {input.pool} --selection {input.selection}"
        " --out {output.model} --metrics {output.metrics}"
        " --distribution {params.distribution} --seed {wildcards.seed} --threads {threads}"
        " --config {params.cfg:q} > {log} 2>&1"


if FUSE_SEEDS:

    # sweep.accuracy.fuse_seeds: the seeds of a one-GPU run, one after the other in one
    # `python -m clusterft.stages.train` process (its imports paid once), each trained exactly as
    # the train rule would (tests/test_train_seeds.py compares the weights byte for byte).
    # `--forcerun train_seeds` retrains them; a killed job retrains all its seeds.
    rule train_seeds:
        input:
            model="results/models/{model}/base",
            pool="results/data/{dataset}/pool.jsonl",
            selection=per_seed(SELECTION),
        output:
            model=[directory(p) for p in per_seed(f"results/train/{RUN}/model")],
            metrics=per_seed(f"results/train/{RUN}/train_metrics.json"),
        log:
            f"logs/train/{RUN_SEEDS}.log",
        benchmark:
            f"benchmarks/out/train/{RUN_SEEDS}.tsv"
        wildcard_constraints:
            gpus="1",
        priority: JOBS.train_priority
        conda:
            ENV
        threads: 1
        resources:
            mem_mb=JOBS.memory("train_seeds", 4000),
            runtime=JOBS.runtime("train_seeds", 600 * len(SEEDS)),
            gpu=lambda w: JOBS.train_job(w)["gpu"],
        params:
            launcher=JOBS.train_launcher,
            cfg=JOBS.train_seeds_cfg,
            distribution=distribution_of,
            seeds=SEEDS,
        shell:
            "{params.launcher} -m clusterft.stages.train"
            " --model {input.model} --pool {input.pool} --selection {input.selection}"
            " --out {output.model} --metrics {output.metrics}"
            " --distribution {params.distribution} --seed {params.seeds} --threads {threads}"
            " --config {params.cfg:q} > {log} 2>&1"

    ruleorder: train_seeds > train
