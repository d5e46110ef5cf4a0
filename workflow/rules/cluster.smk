# Cosine k-means of the gradient features: examples with a similar training effect.


rule cluster:
    input:
        features="results/score/{dataset}/{model}/s{seed}/features.npy",
        scores="results/score/{dataset}/{model}/s{seed}/scores.parquet",
    output:
        clusters="results/cluster/{dataset}/{model}/s{seed}/clusters.parquet",
        centroids="results/cluster/{dataset}/{model}/s{seed}/centroids.npy",
    log:
        "logs/cluster/{dataset}/{model}/s{seed}.log",
    benchmark:
        "benchmarks/out/cluster/{dataset}/{model}/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        cfg=section("cluster"),
    script:
        "../scripts/cluster.py"
