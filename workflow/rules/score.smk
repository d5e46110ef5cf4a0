# Gradient features: per-example LoRA gradients of a briefly warmed-up model,
# randomly projected and L2-normalised, plus a scalar score per example; the same warm-up
# records each example's loss trajectory (S2L's signal) and gives the benchmark tasks'
# validation examples the same features (LESS's targets).


rule score:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
        task_items=task_item_dirs,
    output:
        features="results/score/{dataset}/{model}/s{seed}/features.npy",
        scores="results/score/{dataset}/{model}/s{seed}/scores.parquet",
        trajectories="results/score/{dataset}/{model}/s{seed}/trajectories.npy",
        targets="results/score/{dataset}/{model}/s{seed}/targets.npy",
        target_ids="results/score/{dataset}/{model}/s{seed}/targets.parquet",
    log:
        "logs/score/{dataset}/{model}/s{seed}.log",
    benchmark:
        "benchmarks/out/score/{dataset}/{model}/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=8000,
        runtime=240,
    params:
        cfg=section("score"),
        length_policy=length_policy,
        tasks=eval_tasks,
    script:
        "../scripts/score.py"
