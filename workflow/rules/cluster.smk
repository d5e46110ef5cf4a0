# Cosine k-means of one feature kind: gradients (the method), embeddings, TF-IDF or loss
# trajectories; examples with a similar training effect (or text, or learning curve).


rule cluster:
    input:
        unpack(JOBS.cluster_inputs),
    output:
        clusters="results/cluster/{dataset}/{model}/{kind}/s{seed}/clusters.parquet",
        centroids="results/cluster/{dataset}/{model}/{kind}/s{seed}/centroids.npy",
    log:
        "logs/cluster/{dataset}/{model}/{kind}/s{seed}.log",
    benchmark:
        "benchmarks/out/cluster/{dataset}/{model}/{kind}/s{seed}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=JOBS.memory("cluster", 4000),
        runtime=JOBS.runtime("cluster", 30),
    params:
        cfg=section("cluster"),
    script:
        "../scripts/cluster.py"
