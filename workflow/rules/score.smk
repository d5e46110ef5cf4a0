# Gradient features: per-example LoRA gradients of a briefly warmed-up model,
# randomly projected and L2-normalised, plus a scalar score per example.


rule score:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
    output:
        features="results/score/{dataset}/{model}/s{seed}/features.npy",
        scores="results/score/{dataset}/{model}/s{seed}/scores.parquet",
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
    script:
        "../scripts/score.py"
