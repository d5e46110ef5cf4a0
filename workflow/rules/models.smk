# Tokenizer and base models: built and pretrained locally (embedded default)
# or resolved from hub ids / local paths (config/paper.yaml). Same DAG either way.


rule tokenizer:
    input:
        corpus="results/corpus/general.txt",
        download=download_manifest,
    output:
        directory("results/models/tokenizer"),
    log:
        "logs/tokenizer.log",
    benchmark:
        "benchmarks/out/tokenizer.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        cfg=section("tokenizer"),
        download=JOBS.download_section,
        allow_downloads=config["allow_downloads"],
        seed=config["data_seed"],
    script:
        "../scripts/tokenizer.py"


rule base_model:
    input:
        tokenizer="results/models/tokenizer",
        corpus="results/corpus/general.txt",
        download=download_manifest,
    output:
        directory("results/models/{model}/base"),
    log:
        "logs/base_model/{model}.log",
    benchmark:
        "benchmarks/out/base_model/{model}.tsv"
    # Before every other ready job: everything of its model waits on it, and a two-thread
    # job of priority 0 waits until no one-thread job is ready (in the whole run after the
    # quick target, the large model's pretraining did not start while the small cells ran)
    priority: 100
    conda:
        ENV
    # Two threads: the small base model (pretraining, then practice) takes 418 s on 2 cores
    # against 548 s on 1, the large 622 s against about 930 s (benchmarks/README.md), and the
    # small one alone stands between a newcomer and the quick target's first result; in the
    # whole run the two base models then take turns instead of sharing the cores.
    threads: 2
    resources:
        mem_mb=JOBS.memory("base_model", 8000),
        runtime=JOBS.runtime("base_model", 120),
    params:
        cfg=JOBS.base_model_cfg,
        download=JOBS.download_section,
        allow_downloads=config["allow_downloads"],
        seed=config["data_seed"],
    script:
        "../scripts/base_model.py"
