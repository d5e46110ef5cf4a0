# Embedded data: instruction pools + held-out benchmark items per dataset, and the
# general corpus (disjoint from both) for the tokenizer and base-model pretraining.
from clusterft.stages.data.benchmark_docs import OUT_DIR as BENCHMARK_DOCS_DIR

CONTAMINATION_TABLE = "results/tables/contamination.csv"
# The named lm-eval tasks' item folder, or nothing (the embedded default names none).
BENCHMARK_DOCS = JOBS.benchmark_docs_dirs()


rule prepare_data:
    input:
        download=download_manifest,
    output:
        pool="results/data/{dataset}/pool.raw.jsonl",
        labels="results/data/{dataset}/labels.parquet",
        summary="results/data/{dataset}/summary.json",
        task_items=directory("results/tasks/{dataset}"),
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
        cfg=JOBS.dataset_cfg,
        seed=config["data_seed"],
        mirror=JOBS.mirror,
    script:
        "../scripts/prepare_data.py"


# The named lm-eval tasks (tasks.lm_eval_tasks: config/paper.yaml), read by lm-eval's own
# task definitions from the download rule's mirror, as items: their test documents (which
# decontaminate checks every pool against) and dev items (LESS's and RDS+'s targets), and
# summary.json saying which tasks could not be read (clusterft.stages.data.benchmark_docs).
# In the DAG only where the config names lm-eval tasks.
rule benchmark_docs:
    input:
        manifest=download_manifest,
    output:
        docs=directory(BENCHMARK_DOCS_DIR),
    log:
        "logs/benchmark_docs.log",
    benchmark:
        "benchmarks/out/benchmark_docs.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        tasks=JOBS.benchmark_docs_tasks(),
        mirror=JOBS.mirror,
        seed=config["data_seed"],
        confirm_run_unsafe_code=JOBS.confirm_run_unsafe_code,
    script:
        "../scripts/benchmark_docs.py"


# Every pool against every benchmark task's items (exact, 13-gram, near-duplicate), the
# named lm-eval tasks' test documents included: overlapping examples dropped or flagged
# (tasks.decontaminate); fails if more than tasks.max_overlap overlapping examples remain
# for a task. Runs before score.
rule decontaminate:
    input:
        pool="results/data/{dataset}/pool.raw.jsonl",
        task_items=expand("results/tasks/{dataset}", dataset=DATASETS) + BENCHMARK_DOCS,
    output:
        pool="results/data/{dataset}/pool.jsonl",
        counts="results/data/{dataset}/contamination.csv",
    log:
        "logs/decontaminate/{dataset}.log",
    benchmark:
        "benchmarks/out/decontaminate/{dataset}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    params:
        cfg=JOBS.decontaminate_cfg,
    script:
        "../scripts/decontaminate.py"


rule contamination_table:
    input:
        expand("results/data/{dataset}/contamination.csv", dataset=DATASETS),
    output:
        report(
            CONTAMINATION_TABLE,
            caption="../report/contamination.rst",
            category="Tables",
        ),
    log:
        "logs/contamination_table.log",
    benchmark:
        "benchmarks/out/contamination_table.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    script:
        "../scripts/contamination_table.py"


rule corpus:
    input:
        pools=expand("results/data/{dataset}/pool.raw.jsonl", dataset=DATASETS),
        task_items=expand("results/tasks/{dataset}", dataset=DATASETS),
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
