# Embedded data: instruction pools + held-out benchmark items per dataset, and the
# general corpus (disjoint from both) for the tokenizer and base-model pretraining.


rule prepare_data:
    output:
        pool="results/data/{dataset}/pool.jsonl",
        labels="results/data/{dataset}/labels.parquet",
        summary="results/data/{dataset}/summary.json",
        benchmarks=directory("results/benchmarks/{dataset}"),
    log:
        "logs/prepare_data/{dataset}.log",
    benchmark:
        "benchmarks/out/prepare_data/{dataset}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    params:
        cfg=dataset_cfg,
        seed=config["data_seed"],
    script:
        "../scripts/prepare_data.py"


rule corpus:
    input:
        pools=expand("results/data/{dataset}/pool.jsonl", dataset=DATASETS),
        benchmarks=expand("results/benchmarks/{dataset}", dataset=DATASETS),
    output:
        "results/corpus/general.txt",
    log:
        "logs/corpus.log",
    benchmark:
        "benchmarks/out/corpus.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    params:
        cfg=section("corpus"),
        seed=config["data_seed"],
    script:
        "../scripts/corpus.py"
