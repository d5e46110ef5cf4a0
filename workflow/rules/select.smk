# Budgeted selection: full data, a uniform random subset, or per-cluster quotas.


rule select:
    input:
        clusters="results/cluster/{dataset}/{model}/s{seed}/clusters.parquet",
        scores="results/score/{dataset}/{model}/s{seed}/scores.parquet",
    output:
        selection="results/select/{dataset}/{model}/{method}-{budget}/s{seed}/selection.parquet",
        summary="results/select/{dataset}/{model}/{method}-{budget}/s{seed}/selection.json",
    log:
        "logs/select/{dataset}/{model}/{method}-{budget}/s{seed}.log",
    benchmark:
        "benchmarks/out/select/{dataset}/{model}/{method}-{budget}/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        cfg=section("select"),
    script:
        "../scripts/select.py"
