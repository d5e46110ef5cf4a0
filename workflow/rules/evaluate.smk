# lm-eval on the benchmarks of the run's domain (repo-defined tasks in the embedded
# default; named lm-eval tasks with config/paper.yaml).


rule evaluate:
    input:
        model=f"results/train/{RUN}/model",
        task_items=task_item_dirs,
    output:
        results=f"results/eval/{RUN}/results.json",
        raw=f"results/eval/{RUN}/results.lm_eval.json",
        per_item=f"results/eval/{RUN}/items.parquet",
        tasks=directory(f"results/eval/{RUN}/tasks"),
    log:
        f"logs/evaluate/{RUN}.log",
    benchmark:
        f"benchmarks/out/evaluate/{RUN}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
        gpu=1 if USE_GPU else 0,
    params:
        tasks=eval_tasks,
        cfg=section("evaluate"),
    script:
        "../scripts/evaluate.py"


# The base model before fine-tuning, on the same tasks.
use rule evaluate as evaluate_base with:
    input:
        model="results/models/{model}/base",
        task_items=task_item_dirs,
    output:
        results="results/eval/{dataset}/{model}/base/results.json",
        raw="results/eval/{dataset}/{model}/base/results.lm_eval.json",
        per_item="results/eval/{dataset}/{model}/base/items.parquet",
        tasks=directory("results/eval/{dataset}/{model}/base/tasks"),
    log:
        "logs/evaluate/{dataset}/{model}/base.log",
    benchmark:
        "benchmarks/out/evaluate/{dataset}/{model}/base.tsv"
