# lm-eval on the benchmarks of the run's domain (repo-defined tasks in the embedded
# default; named lm-eval tasks with config/paper.yaml). With evaluate.shards > 1 each run's
# tasks are evaluated in that many jobs (evaluate_shard) and merged (evaluate) into the
# same outputs.
EVAL = CFG["evaluate"]
EVAL_GPUS = EVAL["gpus"] if USE_GPU else 0
SHARD = "shards/{shard}-of-{nshards}"

if EVAL["shards"] == 1:

    rule evaluate:
        input:
            model=f"results/train/{RUN}/model",
            task_items=task_item_dirs,
            download=download_manifest,
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
            mem_mb=JOBS.memory("evaluate", 4000),
            runtime=JOBS.runtime("evaluate", 120),
            gpu=1 if USE_GPU else 0,
        params:
            tasks=eval_tasks,
            cfg=section("evaluate"),
            mirror=JOBS.mirror,
        script:
            "../scripts/evaluate.py"

    # The base model before fine-tuning, on the same tasks.
    use rule evaluate as evaluate_base with:
        input:
            model="results/models/{model}/base",
            task_items=task_item_dirs,
            download=download_manifest,
        output:
            results="results/eval/{dataset}/{model}/base/results.json",
            raw="results/eval/{dataset}/{model}/base/results.lm_eval.json",
            per_item="results/eval/{dataset}/{model}/base/items.parquet",
            tasks=directory("results/eval/{dataset}/{model}/base/tasks"),
        log:
            "logs/evaluate/{dataset}/{model}/base.log",
        benchmark:
            "benchmarks/out/evaluate/{dataset}/{model}/base.tsv"

else:

    # One shard: the run's model on every evaluate.shards-th task.
    rule evaluate_shard:
        input:
            model=f"results/train/{RUN}/model",
            task_items=task_item_dirs,
            download=download_manifest,
        output:
            results=f"results/eval/{RUN}/{SHARD}/results.json",
            raw=f"results/eval/{RUN}/{SHARD}/results.lm_eval.json",
            per_item=f"results/eval/{RUN}/{SHARD}/items.parquet",
            tasks=directory(f"results/eval/{RUN}/{SHARD}/tasks"),
        log:
            f"logs/evaluate_shard/{RUN}/{SHARD}.log",
        benchmark:
            f"benchmarks/out/evaluate_shard/{RUN}/{SHARD}.tsv"
        wildcard_constraints:
            shard=r"[0-9]+",
            nshards=r"[0-9]+",
        conda:
            ENV
        threads: 1
        resources:
            mem_mb=JOBS.memory("evaluate_shard", 4000),
            runtime=JOBS.runtime("evaluate_shard", 120),
            gpu=EVAL_GPUS,
        params:
            tasks=JOBS.eval_shard_tasks,
            cfg=section("evaluate"),
            mirror=JOBS.mirror,
        script:
            "../scripts/evaluate.py"

    use rule evaluate_shard as evaluate_base_shard with:
        input:
            model="results/models/{model}/base",
            task_items=task_item_dirs,
            download=download_manifest,
        output:
            results=f"results/eval/{{dataset}}/{{model}}/base/{SHARD}/results.json",
            raw=f"results/eval/{{dataset}}/{{model}}/base/{SHARD}/results.lm_eval.json",
            per_item=f"results/eval/{{dataset}}/{{model}}/base/{SHARD}/items.parquet",
            tasks=directory(f"results/eval/{{dataset}}/{{model}}/base/{SHARD}/tasks"),
        log:
            f"logs/evaluate_shard/{{dataset}}/{{model}}/base/{SHARD}.log",
        benchmark:
            f"benchmarks/out/evaluate_shard/{{dataset}}/{{model}}/base/{SHARD}.tsv"

    # The shards merged into the outputs one evaluate job writes (CPU only, seconds).
    rule evaluate:
        input:
            unpack(JOBS.eval_shards(f"results/eval/{RUN}")),
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
            mem_mb=2000,
            runtime=10,
            gpu=0,
        params:
            tasks=eval_tasks,
            cfg=section("evaluate"),
        script:
            "../scripts/evaluate_merge.py"

    use rule evaluate as evaluate_base with:
        input:
            unpack(JOBS.eval_shards("results/eval/{dataset}/{model}/base")),
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


if FUSE_SEEDS and EVAL["shards"] == 1:

    # sweep.accuracy.fuse_seeds: the seeds of a one-GPU run evaluated one after the other
    # in one process (lm-eval, torch and transformers imported once), each exactly as the
    # evaluate rule would (tests/test_evaluate.py compares the results).
    rule evaluate_seeds:
        input:
            model=per_seed(f"results/train/{RUN}/model"),
            task_items=task_item_dirs,
            download=download_manifest,
        output:
            results=per_seed(f"results/eval/{RUN}/results.json"),
            raw=per_seed(f"results/eval/{RUN}/results.lm_eval.json"),
            per_item=per_seed(f"results/eval/{RUN}/items.parquet"),
            tasks=[directory(p) for p in per_seed(f"results/eval/{RUN}/tasks")],
        log:
            f"logs/evaluate/{RUN_SEEDS}.log",
        benchmark:
            f"benchmarks/out/evaluate/{RUN_SEEDS}.tsv"
        wildcard_constraints:
            gpus="1",
        conda:
            ENV
        threads: 1
        resources:
            mem_mb=JOBS.memory("evaluate_seeds", 4000),
            runtime=JOBS.runtime("evaluate_seeds", 120 * len(SEEDS)),
            gpu=1 if USE_GPU else 0,
        params:
            tasks=eval_tasks,
            cfg=section("evaluate"),
            mirror=JOBS.mirror,
            seeds=SEEDS,
        script:
            "../scripts/evaluate_seeds.py"

    ruleorder: evaluate_seeds > evaluate
