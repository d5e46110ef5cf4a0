# The other feature kinds the same cluster and select code runs on: the base model's
# embeddings (with the benchmark tasks' validation examples', RDS+'s targets) and TF-IDF of
# the text (clusterft.stages.features.representations), and the score warm-up's loss trajectories
# (clusterft.stages.features.trajectories, S2L's signal).


rule embedding_features:
    input:
        model="results/models/{model}/base",
        pool="results/data/{dataset}/pool.jsonl",
        task_items=JOBS.target_item_dirs,
    output:
        features="results/features/{dataset}/{model}/embedding/s{seed}/features.npy",
        scores="results/features/{dataset}/{model}/embedding/s{seed}/scores.parquet",
        targets="results/features/{dataset}/{model}/embedding/s{seed}/targets.npy",
        target_ids="results/features/{dataset}/{model}/embedding/s{seed}/targets.parquet",
    log:
        "logs/features/{dataset}/{model}/embedding/s{seed}.log",
    benchmark:
        "benchmarks/out/features/{dataset}/{model}/embedding/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=JOBS.memory("embedding_features", 4000),
        runtime=JOBS.runtime("embedding_features", 60),
        gpu=SCORE_GPU,
    params:
        cfg=section("features"),
        tasks=eval_tasks,
    script:
        "../scripts/features.py"


rule tfidf_features:
    input:
        pool="results/data/{dataset}/pool.jsonl",
    output:
        features="results/features/{dataset}/{model}/tfidf/s{seed}/features.npy",
        scores="results/features/{dataset}/{model}/tfidf/s{seed}/scores.parquet",
    log:
        "logs/features/{dataset}/{model}/tfidf/s{seed}.log",
    benchmark:
        "benchmarks/out/features/{dataset}/{model}/tfidf/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        cfg=section("features"),
        tasks=[],
    script:
        "../scripts/features.py"


rule loss_features:
    input:
        trajectories="results/score/{dataset}/{model}/s{seed}/trajectories.npy",
        scores="results/score/{dataset}/{model}/s{seed}/scores.parquet",
    output:
        features="results/features/{dataset}/{model}/loss/s{seed}/features.npy",
        scores="results/features/{dataset}/{model}/loss/s{seed}/scores.parquet",
    log:
        "logs/features/{dataset}/{model}/loss/s{seed}.log",
    benchmark:
        "benchmarks/out/features/{dataset}/{model}/loss/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/loss_features.py"
