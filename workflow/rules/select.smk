# Budgeted selection: full data, random, per-cluster quotas on the clusters of the method's
# features (cluster, embed-cluster, tfidf-cluster, s2l), the oracle's true labels, or RS2.


rule select:
    input:
        unpack(JOBS.select_inputs),
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
        epochs=JOBS.select_epochs,
    script:
        "../scripts/select.py"
