# Config validation, sweep targets and input functions shared by every rule file.
import json
import os
from itertools import product
from pathlib import Path

from snakemake.utils import validate

# The package lives in workflow/clusterft; make it importable by every job,
# installed (pip install -e .) or not, with or without --sdm conda.
# Jobs inherit this environment; the venv's bin (torchrun) goes first on PATH too.
PKG_DIR = str(Path(workflow.basedir) / "workflow")
_env = dict(os.environ)
os.environ.update(
    {
        "PYTHONPATH": os.pathsep.join(
            p for p in (PKG_DIR, _env.get("PYTHONPATH")) if p
        ),
        "PATH": os.pathsep.join(
            (str(Path(sys.executable).parent), _env.get("PATH", ""))
        ),
    }
)
if PKG_DIR not in sys.path:
    sys.path.insert(0, PKG_DIR)

from clusterft.pipeline.names import (
    BASE,
    DISTRIBUTIONS,
    FEATURE_KINDS,
    FULL,
    GRADIENT,
    METHODS,
    ORACLE,
    RS2,
    TARGET_AWARE,
    features_of,
)
from clusterft.stages.evaluate import merge_cfg as eval_merge_cfg, shard_tasks
from clusterft.plan.config import (
    budget_label,
    check_config,
    config_warnings,
    tasks_for,
    validate_schema,
)

# Errors name the config file, the line and the field (the last --configfile, which sets
# most keys; config/config.yaml when none is given).
CONFIG_SOURCE = str(
    (workflow.config_settings.configfiles or ["config/config.yaml"])[-1]
)
validate_schema(config, source=CONFIG_SOURCE)
validate(config, schema="../schemas/config.schema.yaml")  # fills the schema's defaults
check_config(config, source=CONFIG_SOURCE)
for _msg in config_warnings(config, source=CONFIG_SOURCE):
    print(f"Warning: {_msg}", file=sys.stderr)

ENV = "../../envs/clusterft.yaml"
DATASETS = list(config["datasets"])
MODELS = list(config["models"])
SEEDS = list(config["seeds"])
USE_GPU = config["train"].get("device", "cpu") == "cuda"
RUN = "{dataset}/{model}/{method}-{budget}/g{gpus}-{dist}/s{seed}"
# sweep.accuracy.fuse_seeds: the seeds of a one-GPU accuracy run train in one job
# (train_seeds) and evaluate in one job (evaluate_seeds), one after the other in one
# process, sharing its start-up; logs and benchmarks go to <run>/s<seed>+<seed>+... .
FUSE_SEEDS = bool(config["sweep"]["accuracy"].get("fuse_seeds", False))
SEEDS_TAG = "+".join(str(s) for s in SEEDS)
RUN_SEEDS = RUN.replace("s{seed}", f"s{SEEDS_TAG}")


def per_seed(pattern):
    """`pattern` (with a {seed} wildcard among others) for every seed of the config."""
    return [pattern.replace("{seed}", str(s)) for s in SEEDS]


def fused(run):
    """Whether a run's train and evaluate jobs are the fused ones of its seeds."""
    return (
        FUSE_SEEDS
        and int(run["gpus"]) == 1
        and int(run["seed"]) in [int(s) for s in SEEDS]
    )


wildcard_constraints:
    dataset="|".join(DATASETS),
    model="|".join(MODELS),
    method="|".join(METHODS),
    budget=r"[0-9]+(\.[0-9]+)?",
    gpus=r"[1-9][0-9]*",
    dist="|".join(DISTRIBUTIONS),
    seed=r"[0-9]+",
    kind="|".join(FEATURE_KINDS),


def in_group(group, method, model):
    """Whether an optional sweep group (curve, baselines, distribution_ablation) covers
    this method on this model (its `models`, when set, restrict it)."""
    return method in group.get("methods", []) and model in group.get("models", MODELS)


def accuracy_runs():
    """Runs of the accuracy-vs-data sweep, all at one GPU count: every method of
    sweep.methods (and of sweep.baselines, on its models) at every budget of sweep.budgets,
    the sweep.curve methods at its extra budgets too, and the sweep.distribution_ablation
    methods at sweep.budgets with the other distribution."""
    sweep = config["sweep"]
    acc = sweep["accuracy"]
    curve = sweep.get("curve") or {}
    baselines = sweep.get("baselines") or {}
    ablation = sweep.get("distribution_ablation") or {}
    methods = list(sweep["methods"]) + [
        m for m in baselines.get("methods", []) if m not in sweep["methods"]
    ]
    for dataset, model, seed, method in product(DATASETS, MODELS, SEEDS, methods):
        if method not in sweep["methods"] and not in_group(baselines, method, model):
            continue
        budgets = list(sweep["budgets"])
        if in_group(curve, method, model):
            budgets += [b for b in curve.get("budgets", []) if b not in budgets]
        dists = [acc["distribution"]]
        if in_group(ablation, method, model):
            dists.append(ablation["distribution"])
        for budget, dist in product(
            [1.0] if method == FULL else sorted(budgets), dists
        ):
            if dist != acc["distribution"] and budget not in sweep["budgets"]:
                continue
            yield dict(
                dataset=dataset,
                model=model,
                method=method,
                budget=budget_label(budget),
                gpus=acc["gpus"],
                dist=dist,
                seed=seed,
            )


def time_runs():
    """Runs of the time sweep: full data and the chosen methods across GPU counts and distributions."""
    t = config["sweep"]["time"]
    for dataset, model, seed, gpus, dist in product(
        DATASETS, t.get("models", MODELS), t["seeds"], t["gpus"], t["distributions"]
    ):
        yield dict(
            dataset=dataset,
            model=model,
            method=FULL,
            budget=budget_label(1.0),
            gpus=gpus,
            dist=dist,
            seed=seed,
        )
        for method, budget in product(t["methods"], t["budgets"]):
            yield dict(
                dataset=dataset,
                model=model,
                method=method,
                budget=budget_label(1.0 if method == FULL else budget),
                gpus=gpus,
                dist=dist,
                seed=seed,
            )


def unique(runs):
    seen, out = set(), []
    for r in runs:
        key = tuple(sorted(r.items()))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


ACCURACY_RUNS = unique(accuracy_runs())
TIME_RUNS = unique(time_runs())


def run_path(prefix, run, suffix):
    return f"results/{prefix}/{RUN.format(**run)}/{suffix}"


def run_record(run, with_eval):
    """One run of the report's run table: its keys and the result files it reads."""
    return {
        **{k: run[k] for k in ("dataset", "model", "method", "budget", "gpus", "seed")},
        "distribution": run["dist"],
        "role": run_role(run, with_eval),
        "eval_json": run_path("eval", run, "results.json") if with_eval else None,
        "items": run_path("eval", run, "items.parquet") if with_eval else None,
        "selection": selection_path(run) if run["method"] != FULL else None,
        "train_metrics_json": run_path("train", run, "train_metrics.json"),
    }


def run_role(run, with_eval):
    """accuracy, ablation (an accuracy run with the other distribution) or time."""
    if not with_eval:
        return "time"
    main = config["sweep"]["accuracy"]["distribution"]
    return "accuracy" if run["dist"] == main else "ablation"


SELECTION = (
    "results/select/{dataset}/{model}/{method}-{budget}/s{seed}/selection.parquet"
)


def selection_path(run):
    return SELECTION.format(**run)


def run_records():
    """Every run the report reads: the accuracy runs (evaluated), the time-only runs
    (train metrics only) and each base model's evaluation (no training)."""
    runs = [run_record(r, True) for r in ACCURACY_RUNS]
    runs += [run_record(r, False) for r in TIME_RUNS if r not in ACCURACY_RUNS]
    runs += [
        {
            "dataset": d,
            "model": m,
            "method": BASE,
            "budget": 0.0,
            "seed": 0,
            "eval_json": f"results/eval/{d}/{m}/{BASE}/results.json",
            "items": f"results/eval/{d}/{m}/{BASE}/items.parquet",
        }
        for d, m in product(DATASETS, MODELS)
    ]
    return runs


def report_inputs():
    return dict(
        evals=[run_path("eval", r, "results.json") for r in ACCURACY_RUNS],
        base_evals=[
            f"results/eval/{d}/{m}/{BASE}/results.json"
            for d, m in product(DATASETS, MODELS)
        ],
        metrics=[
            run_path("train", r, "train_metrics.json")
            for r in unique(ACCURACY_RUNS + TIME_RUNS)
        ],
        per_item=[run_path("eval", r, "items.parquet") for r in ACCURACY_RUNS],
        selections=sorted(
            {selection_path(r) for r in ACCURACY_RUNS if r["method"] != FULL}
        ),
        clusters=[c["clusters"] for c in cluster_records()],
        labels=[f"results/data/{d}/labels.parquet" for d in DATASETS],
    )


def cluster_records():
    """Every feature kind's clusters per dataset, model and seed, for the skill-recovery
    table (the method never reads the labels; the report does)."""
    return [
        {
            "dataset": d,
            "model": m,
            "seed": s,
            "features": k,
            "clusters": f"results/cluster/{d}/{m}/{k}/s{s}/clusters.parquet",
            "labels": f"results/data/{d}/labels.parquet",
        }
        for d, m, s, k in product(DATASETS, MODELS, SEEDS, FEATURE_KINDS)
    ]


REPORT_TABLES = [
    "accuracy_vs_data",
    "time",
    "balance_cost",
    "skill_recovery",
    "label_counts",
    "comparisons",
]


def report_outputs():
    return (
        [f"results/tables/{t}.{ext}" for t in REPORT_TABLES for ext in ("csv", "md")]
        + ["results/tables/findings.md", "results/tables/claims.md"]
        + [
            f"results/plots/{p}_{d}.png"
            for p in ("accuracy_vs_data", "time")
            for d in DATASETS
        ]
        + ["results/plots/skill_recovery.png"]
    )


def task_item_dirs(wildcards):
    """The task-item folder of the run's dataset (held-out items of its generator)."""
    return [f"results/tasks/{wildcards.dataset}"]


def eval_tasks(wildcards):
    return tasks_for(config, wildcards.dataset)


# evaluate.shards > 1: each run's tasks in that many evaluate_shard jobs, then a merge.
EVAL = eval_merge_cfg(config.get("evaluate"))


def eval_shard_tasks(wildcards):
    """The tasks of one shard of a run's evaluation."""
    groups = shard_tasks(eval_tasks(wildcards), int(wildcards.nshards))
    return groups[int(wildcards.shard)]


def eval_shards(prefix):
    """Input function: the shard outputs (results.json, raw, items) a run's merge reads."""

    def inputs(wildcards):
        folder = prefix.format(**dict(wildcards.items()))
        n = len(shard_tasks(eval_tasks(wildcards), EVAL["shards"]))
        shards = [f"{folder}/shards/{i}-of-{n}" for i in range(n)]
        return {
            "shards": [f"{s}/results.json" for s in shards],
            "shard_raw": [f"{s}/results.lm_eval.json" for s in shards],
            "shard_items": [f"{s}/items.parquet" for s in shards],
        }

    return inputs


def canonical(obj):
    """A config value with dict keys sorted (recursively), so that reordering keys in a
    config file does not count as a change of a rule's params (no spurious reruns)."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [canonical(v) for v in obj]
    return obj


def section(name):
    """A config section for a rule's params (the package merges its DEFAULTS)."""
    return canonical(config.get(name, {}))


def base_model_cfg(wildcards):
    """The model's section without its `train` overrides: what building and pretraining
    the base model depend on (a changed fine-tuning setting must not redo pretraining).
    """
    own = config["models"][wildcards.model]
    return canonical({k: v for k, v in own.items() if k != "train"})


def model_train_section(model):
    """The train section with the model's own `train` overrides merged over it."""
    from clusterft.pipeline.sections import merged

    own = config["models"][model].get("train", {})
    return merged(config.get("train", {}), own)


def is_time_only(wildcards):
    """A run that is not one of the accuracy runs (check_config keeps the two apart when
    sweep.time.epochs is set)."""
    run = {
        k: getattr(wildcards, k)
        for k in ("dataset", "model", "method", "budget", "dist")
    }
    return not any(
        {k: str(r[k]) for k in run} == run
        and int(r["gpus"]) == int(wildcards.gpus)
        and int(r["seed"]) == int(wildcards.seed)
        for r in ACCURACY_RUNS
    )


def train_cfg(wildcards):
    """The model's train section (JSON) for the train rule; time-only runs train
    sweep.time.epochs epochs when that is set."""
    cfg = model_train_section(wildcards.model)
    epochs = config["sweep"]["time"].get("epochs")
    if epochs is not None and is_time_only(wildcards):
        cfg = {**cfg, "epochs": int(epochs)}
    return json.dumps(canonical(cfg))


def train_seeds_cfg(wildcards):
    """train_cfg of a fused job: the same for every seed (check_config keeps time-only
    runs with their own epochs off the accuracy runs' GPU count)."""
    from types import SimpleNamespace

    cfgs = {
        train_cfg(SimpleNamespace(**dict(wildcards.items()), seed=s)) for s in SEEDS
    }
    if len(cfgs) != 1:
        raise ValueError(
            f"sweep.accuracy.fuse_seeds: the seeds of {dict(wildcards.items())} would "
            "train with different settings; set fuse_seeds: false"
        )
    return cfgs.pop()


def train_benchmark(run):
    """The benchmark file of the job that trained `run` (fused: its seeds' one)."""
    return (
        f"benchmarks/out/train/{(RUN_SEEDS if fused(run) else RUN).format(**run)}.tsv"
    )


def train_launcher(wildcards):
    """One rank: plain `python` (torchrun's launcher process adds seconds per job and
    nothing else: one rank trains without a process group; benchmarks/bench_job_overhead.py).
    More ranks on one node: torchrun --standalone. More ranks than the model's
    train.gpus_per_node: srun + one torchrun agent per node, c10d rendezvous
    (clusterft.pipeline.launch.launcher_shell).
    """
    from clusterft.pipeline.launch import launcher_shell

    per_node = model_train_section(wildcards.model).get("gpus_per_node", 0)
    return launcher_shell(int(wildcards.gpus), per_node, gpu=USE_GPU)


def train_job(wildcards):
    """The train job's ranks per node and SLURM resources over nodes, from its GPU count
    and the model's train.gpus_per_node (clusterft.pipeline.launch.job_resources)."""
    from clusterft.pipeline.launch import job_resources

    per_node = model_train_section(wildcards.model).get("gpus_per_node", 0)
    return job_resources(int(wildcards.gpus), per_node, gpu=USE_GPU)


def length_policy(wildcards):
    """The model's train max_length / truncation keys (set ones only) that score checks
    the pool against before any gradient work."""
    cfg = model_train_section(wildcards.model)
    return {k: cfg[k] for k in ("max_length", "truncation") if k in cfg}


CONTAMINATION_TABLE = "results/tables/contamination.csv"


def decontaminate_cfg(wildcards):
    """tasks.decontaminate / max_overlap and the dataset's overlap-check keys only
    (so that changing e.g. the pool size alone reruns prepare_data, not this twice)."""
    from clusterft.pools import OVERLAP_DEFAULTS

    bench = config["tasks"]
    d = config["datasets"][wildcards.dataset]
    return canonical(
        {
            "action": bench.get("decontaminate", "drop"),
            "max_overlap": bench.get("max_overlap", 0),
            **{k: d[k] for k in OVERLAP_DEFAULTS if k in d},
        }
    )


def dataset_cfg(wildcards):
    """A dataset's section; tasks.items_per_task applies unless the dataset sets it."""
    items = config["tasks"].get("items_per_task")
    extra = {"items_per_task": items} if items is not None else {}
    return canonical({**extra, **config["datasets"][wildcards.dataset]})


def features_paths(dataset, model, kind, seed):
    """features.npy and scores.parquet of one feature kind (the gradient kind is score's)."""
    folder = (
        f"results/score/{dataset}/{model}/s{seed}"
        if kind == GRADIENT
        else f"results/features/{dataset}/{model}/{kind}/s{seed}"
    )
    return {"features": f"{folder}/features.npy", "scores": f"{folder}/scores.parquet"}


def cluster_inputs(wildcards):
    return features_paths(
        wildcards.dataset, wildcards.model, wildcards.kind, wildcards.seed
    )


def select_inputs(wildcards):
    """The clusters of the method's features and that run's scores; the oracle also reads
    the true labels."""
    kind = features_of(wildcards.method)
    where = f"{wildcards.dataset}/{wildcards.model}/{kind}/s{wildcards.seed}"
    out = {
        "clusters": f"results/cluster/{where}/clusters.parquet",
        "scores": features_paths(
            wildcards.dataset, wildcards.model, kind, wildcards.seed
        )["scores"],
    }
    if wildcards.method == ORACLE:
        out["labels"] = f"results/data/{wildcards.dataset}/labels.parquet"
    if wildcards.method in TARGET_AWARE:
        folder = os.path.dirname(out["scores"])
        out["features"] = f"{folder}/features.npy"
        out["targets"] = f"{folder}/targets.npy"
        out["target_ids"] = f"{folder}/targets.parquet"
    return out


def select_epochs(wildcards):
    """RS2's per-epoch subsets: as many as the model's longest training run has epochs."""
    if wildcards.method != RS2:
        return 1
    from clusterft.stages.train import DEFAULTS as TRAIN_DEFAULTS

    cfg = {**TRAIN_DEFAULTS, **model_train_section(wildcards.model)}
    return int(cfg["epochs"])


# score.shards > 1: one score_warmup job, score.shards score_shard jobs, score merges
# (workflow/rules/score.smk; clusterft.stages.score, "sharded scoring").
SCORE_SHARDS = int(config.get("score", {}).get("shards", 1))
SCORE_WARMUP = "results/score/{dataset}/{model}/s{seed}/warmup.safetensors"
SCORE_SHARD = "results/score/{dataset}/{model}/s{seed}/shards/shard{shard}.npz"


def score_inputs(wildcards):
    """The score rule's model, pool and task items; with shards, the warm-up and every
    shard too (the rule then merges them)."""
    out = {
        "model": f"results/models/{wildcards.model}/base",
        "pool": f"results/data/{wildcards.dataset}/pool.jsonl",
        "task_items": task_item_dirs(wildcards),
    }
    if SCORE_SHARDS > 1:
        out["warmup"] = SCORE_WARMUP.format(**wildcards)
        out["shards"] = [
            SCORE_SHARD.format(shard=i, **wildcards) for i in range(SCORE_SHARDS)
        ]
    return out


def score_warmup_cfg(wildcards):
    """The score section without `shards`: changing the job count keeps the warm-up."""
    return {k: v for k, v in section("score").items() if k != "shards"}
