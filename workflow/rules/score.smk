# Gradient features: per-example LoRA gradients of a briefly warmed-up model,
# randomly projected and L2-normalised, plus a scalar score per example; the same warm-up
# records each example's loss trajectory (S2L's signal) and gives the benchmark tasks'
# validation examples the same features (LESS's targets).
# With score.shards > 1 (clusterft.stages.score.entry): score_warmup trains the warm-up
# once, score.shards score_shard jobs (one GPU each) compute consecutive runs of the
# gradient pass's batches, and score merges them; with 1, the score job does all three in
# one process (the same code path), so both give the same files, bit for bit.

from clusterft.plan.inputs import SCORE_DIR, SCORE_SHARD, SCORE_WARMUP

SCORE_SHARDS = JOBS.score_shards
# One GPU per job that runs the model (the warm-up, each shard, or the one score job):
# score.device cuda, or auto where the training runs on GPUs (train.device: cuda).
SCORE_GPU = JOBS.score_gpu


wildcard_constraints:
    shard=r"[0-9]+",


rule score_warmup:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
    output:
        warmup=SCORE_WARMUP,
    log:
        "logs/score_warmup/{dataset}/{model}/s{seed}.log",
    benchmark:
        "benchmarks/out/score_warmup/{dataset}/{model}/s{seed}.tsv"
    # on every method run's path (and full data's balanced deal): before the other features
    priority: 100
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=JOBS.memory("score_warmup", 8000),
        runtime=JOBS.runtime("score_warmup", 240),
        gpu=SCORE_GPU,
    params:
        cfg=JOBS.score_warmup_cfg,
        length_policy=JOBS.length_policy,
    script:
        "../scripts/score_warmup.py"


rule score_shard:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
        warmup=SCORE_WARMUP,
        task_items=JOBS.target_item_dirs,
    output:
        shard=temp(SCORE_SHARD),
    log:
        "logs/score_shard/{dataset}/{model}/s{seed}/shard{shard}.log",
    benchmark:
        "benchmarks/out/score_shard/{dataset}/{model}/s{seed}/shard{shard}.tsv"
    # on every method run's path (and full data's balanced deal): before the other features
    priority: 100
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=JOBS.memory("score_shard", 8000),
        runtime=JOBS.runtime("score_shard", 240),
        gpu=SCORE_GPU,
    params:
        cfg=section("score"),
        tasks=eval_tasks,
    script:
        "../scripts/score_shard.py"


rule score:
    input:
        unpack(JOBS.score_inputs),
    output:
        features=f"{SCORE_DIR}/features.npy",
        scores=f"{SCORE_DIR}/scores.parquet",
        trajectories=f"{SCORE_DIR}/trajectories.npy",
        targets=f"{SCORE_DIR}/targets.npy",
        target_ids=f"{SCORE_DIR}/targets.parquet",
    log:
        "logs/score/{dataset}/{model}/s{seed}.log",
    benchmark:
        "benchmarks/out/score/{dataset}/{model}/s{seed}.tsv"
    # on every method run's path (and full data's balanced deal): before the other features
    priority: 100
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=JOBS.memory("score", 8000),
        runtime=JOBS.runtime("score", 240),
        gpu=SCORE_GPU if SCORE_SHARDS == 1 else 0,
    params:
        cfg=section("score"),
        length_policy=JOBS.length_policy,
        tasks=eval_tasks,
    script:
        "../scripts/score.py"
