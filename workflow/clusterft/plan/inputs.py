"""The rules' input and param functions, one group per rule file (pure Python, no
Snakemake): each takes a job's wildcards (Snakemake's, or any object with the wildcard names
as attributes and an `items()`, or a dict) and reads the config through the plan.

    jobs = Inputs(config, plan)   # config: the workflow's config (params are its own
                                  # sections); plan: clusterft.plan.sweep.Sweep of it
    jobs.select_inputs({"dataset": "skills", "model": "tiny", "method": "less", ...})

The rule files (`workflow/rules/<stage>.smk`) name these as `JOBS.<function>`: Snakemake's
lint wants functions out of the files that hold rules, and here they are testable.
Params hand a job the config's own section (the stage merges its DEFAULTS: a default
changed in code is not a changed param); values the workflow itself decides by (GPUs,
shards, epochs of RS2's subsets) come from the plan's settled config.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable

from clusterft.pipeline.names import ORACLE, RS2, TARGET_AWARE, features_of, split_dist
from clusterft.pipeline.sections import merged
from clusterft.plan.config import dataset_train, run_train, tasks_for
from clusterft.plan.sweep import Sweep, features_paths

SCORE_DIR = "results/score/{dataset}/{model}/s{seed}"
SCORE_WARMUP = f"{SCORE_DIR}/warmup.safetensors"
SCORE_SHARD = f"{SCORE_DIR}/shards/shard{{shard}}.npz"


def canonical(obj: Any) -> Any:
    """A config value with dict keys sorted (recursively), so that reordering keys in a
    config file does not count as a change of a rule's params (no spurious reruns)."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [canonical(v) for v in obj]
    return obj


def wild(wildcards: Any) -> SimpleNamespace:
    """Wildcards as attributes, whatever they came as (a dict, Snakemake's Wildcards)."""
    items = wildcards.items() if hasattr(wildcards, "items") else vars(wildcards).items()
    return SimpleNamespace(**dict(items))


class Inputs:
    """Input and param functions of every rule (see the module docstring)."""

    def __init__(self, config: dict, plan: Sweep, cost: Callable[[dict], Any] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.config, self.plan, self.cfg = config, plan, plan.cfg
        # the cost model behind the GPU jobs' runtimes: clusterft.tools.cost.runtime_estimator
        # (a layer above; the rule files hand it in), called once with the settled config.
        # None: every job keeps its rule's fixed runtime, as on CPU.
        self.cost = cost
        # runtime warnings (jobs longer than resources.max_runtime, or a day), each once
        self.warn = warn or (lambda msg: print(f"Warning: {msg}", file=sys.stderr))
        self._warned: set = set()
        self._estimator: Any = None

    # ----------------------------------------------------------------- shared
    def memory(self, rule: str, fixed: int) -> Callable[..., int]:
        """A rule's mem_mb: its fixed value (train: per rank on the node), or more where the
        model and the pool need it, times the attempt (clusterft.plan.resources). A rule
        name the estimate does not know (a merge) keeps its fixed value."""
        from clusterft.plan.resources import estimate_mb, memory_mb

        def mem_mb(wildcards: Any, attempt: int = 1) -> int:
            w = vars(wild(wildcards))
            ranks = self.train_job(wildcards)["ranks_per_node"] if rule == "train" else 1
            key = "score_merge" if rule == "score" and self.score_shards > 1 else rule
            estimate = estimate_mb(key, self.cfg, w.get("model"), w.get("dataset"), ranks)
            return memory_mb(fixed * ranks, estimate, attempt)  # train: fixed per rank

        return mem_mb

    def runtime(self, rule: str, fixed: int) -> Callable[..., int]:
        """A rule's runtime (minutes): its fixed value, or more where the cost model's
        estimate for the job times resources.runtime_safety says so, times the attempt (a
        job killed at its time limit is resubmitted with more: the profile's retries), at
        most resources.max_runtime (clusterft.plan.resources)."""
        from clusterft.plan.resources import runtime_minutes

        def minutes(wildcards: Any, attempt: int = 1) -> int:
            safety, ceiling = self.runtime_limits
            estimate = self.runtime_estimate(rule, wildcards)
            self._check_runtime(rule, wildcards, fixed, estimate)
            return runtime_minutes(fixed, estimate, attempt, safety, ceiling)

        return minutes

    @property
    def runtime_limits(self) -> tuple[float, int | None]:
        """(resources.runtime_safety, resources.max_runtime) of the config."""
        from clusterft.plan.resources import RUNTIME_SAFETY

        res = self.cfg.get("resources") or {}
        return float(res.get("runtime_safety", RUNTIME_SAFETY)), res.get("max_runtime")

    def runtime_estimate(self, rule: str, wildcards: Any) -> float:
        """The cost model's minutes for this job before the safety factor (0: none; GPU
        rules are estimated where the job runs on a GPU only)."""
        from clusterft.plan.resources import GPU_RULES, estimate_minutes

        w = vars(wild(wildcards))
        if rule.startswith("score") or rule == "embedding_features":
            on_gpu = bool(self.score_gpu)
        else:
            on_gpu = self.use_gpu
        if rule in GPU_RULES and on_gpu and self._estimator is None and self.cost is not None:
            self._estimator = self.cost(self.cfg)
        if rule == "train":
            merged = self.plan.is_time_only(w)
        elif rule == "score":
            merged = self.score_shards > 1
        else:
            merged = rule in ("evaluate", "evaluate_base") and int(
                self.cfg["evaluate"]["shards"]) > 1
        return estimate_minutes(rule, self.cfg, w, self._estimator, on_gpu, merged)

    def _check_runtime(self, rule: str, wildcards: Any, fixed: int, estimate: float) -> None:
        """Warn once per rule, dataset, model and kind about a job whose first attempt needs
        more than resources.max_runtime (it is capped there) or, without one, over a day."""
        from clusterft.plan.resources import DAY_MINUTES, SPLIT_HINTS, runtime_need

        safety, ceiling = self.runtime_limits
        need = runtime_need(fixed, estimate, safety)
        limit = int(ceiling) if ceiling else DAY_MINUTES
        w = vars(wild(wildcards))
        key = (rule, w.get("dataset"), w.get("model"), w.get("kind"))
        # without a ceiling only an estimate over a day counts, not a long fixed value
        over = need > limit and (bool(ceiling) or need > int(fixed))
        if not over or key in self._warned:
            return
        self._warned.add(key)
        job = ", ".join(f"{k}={w[k]}" for k in ("dataset", "model", "kind") if k in w)
        what = (f"resources.max_runtime caps it at {limit / 60:.1f} h" if ceiling else
                "longer than many GPU partitions allow (`sinfo -o '%P %l'` lists the limits); "
                "set resources.max_runtime to the partition's limit (minutes) to cap it")
        hint = SPLIT_HINTS.get(rule)
        self.warn(f"{rule} ({job}) asks for {need / 60:.1f} h (runtime_safety {safety:g} x "
                  f"the cost model's {estimate / 60:.1f} h); {what}"
                  + (f"; {hint}" if hint else ""))

    def section(self, name: str) -> dict:
        """A config section for a rule's params (the package merges its DEFAULTS)."""
        return canonical(self.config.get(name) or {})

    def model_train_section(self, model: str, dataset: str | None = None) -> dict:
        """The config's train section with the model's own `train` overrides merged over
        it and, for a run of `dataset`, the dataset's own (epochs, lr) over those (params;
        the plan's `model_train` / `run_train` is the same over train's DEFAULTS)."""
        out = merged(self.config.get("train") or {},
                     self.config["models"][model].get("train") or {})
        return merged(out, dataset_train(self.config, dataset)) if dataset else out

    def task_item_dirs(self, wildcards: Any) -> list[str]:
        """The task-item folder of the run's dataset (held-out items of its generator)."""
        return [f"results/tasks/{wild(wildcards).dataset}"]

    def eval_tasks(self, wildcards: Any) -> list[str]:
        return tasks_for(self.config, wild(wildcards).dataset)

    def benchmark_docs_dirs(self, wildcards: Any = None) -> list[str]:
        """The benchmark_docs rule's folder (the named lm-eval tasks' test documents and dev
        items as items), or nothing where the config names no lm-eval task."""
        from clusterft.stages.data.benchmark_docs import OUT_DIR

        return [OUT_DIR] if self.cfg["tasks"].get("lm_eval_tasks") else []

    def target_item_dirs(self, wildcards: Any) -> list[str]:
        """Where score and features find the tasks' dev items (LESS's and RDS+'s targets):
        the dataset's own task-item folder, then the named lm-eval tasks' (never given to
        evaluate, which would take a task with an item file for a repo-defined one)."""
        return self.task_item_dirs(wildcards) + self.benchmark_docs_dirs()

    # ----------------------------------------------------------------- download.smk
    @property
    def needs_download(self) -> bool:
        """Whether the config names anything the download rule fetches: a hub model or
        tokenizer, a `source: hf` pool read by hub id, lm-eval's built-in tasks."""
        from clusterft.stages.download import needs_download

        return needs_download(self.cfg)

    @property
    def mirror(self) -> str | None:
        """The run's hub-dataset mirror (clusterft.pipeline.mirror) that jobs read hub ids
        from, offline; None when the config reads no hub dataset."""
        from clusterft.stages.download import MIRROR

        return MIRROR if self.needs_download else None

    def download_manifest(self, wildcards: Any = None) -> list[str]:
        """Input of every job that reads downloaded things: the download rule's manifest,
        or nothing (the embedded default's DAG has no download job)."""
        from clusterft.stages.download import MANIFEST

        return [MANIFEST] if self.needs_download else []

    @property
    def download_params(self) -> dict:
        """What the download stage reads: the sections that name outside things, and its own
        (without a dataset's `train`: its runs' epochs / lr fetch nothing)."""
        keys = ("data_seed", "datasets", "tasks", "tokenizer", "models", "download")
        out = {k: self.config[k] for k in keys if k in self.config}
        if "datasets" in out:
            out["datasets"] = {name: {k: v for k, v in (spec or {}).items() if k != "train"}
                               for name, spec in out["datasets"].items()}
        return canonical(out)

    @property
    def download_section(self) -> dict:
        """The download section (where the model cache is), for jobs reading from it."""
        return canonical(self.config.get("download") or {})

    # ----------------------------------------------------------------- data.smk
    def dataset_cfg(self, wildcards: Any) -> dict:
        """A dataset's section; tasks.items_per_task applies unless the dataset sets it.
        Its `models` and `train` (which models run on it, its runs' epochs / lr) leave the
        data unchanged and are left out."""
        items = self.cfg["tasks"]["items_per_task"]
        spec = self.config["datasets"][wild(wildcards).dataset]
        return canonical({"items_per_task": items,
                          **{k: v for k, v in spec.items() if k not in ("models", "train")}})

    def benchmark_docs_tasks(self, wildcards: Any = None) -> list[str]:
        """The lm-eval tasks the config names (tasks.lm_eval_tasks), each once, in order."""
        from clusterft.stages.download import builtin_tasks

        return builtin_tasks(self.cfg)

    @property
    def confirm_run_unsafe_code(self) -> bool:
        """evaluate.confirm_run_unsafe_code: lm-eval's code tasks (humaneval, mbpp) run the
        code_eval metric when their task modules are imported, benchmark_docs too."""
        return bool(self.cfg["evaluate"]["confirm_run_unsafe_code"])

    def decontaminate_cfg(self, wildcards: Any) -> dict:
        """tasks.decontaminate / max_overlap and the dataset's overlap-check keys only
        (so that changing e.g. the pool size alone reruns prepare_data, not this twice)."""
        from clusterft.pools import OVERLAP_DEFAULTS

        d = self.config["datasets"][wild(wildcards).dataset]
        return canonical({"action": self.cfg["tasks"]["decontaminate"],
                          "max_overlap": self.cfg["tasks"]["max_overlap"],
                          **{k: d[k] for k in OVERLAP_DEFAULTS if k in d}})

    # ----------------------------------------------------------------- models.smk
    def base_model_cfg(self, wildcards: Any) -> dict:
        """The model's section without its `train` overrides: what building and pretraining
        the base model depend on (a changed fine-tuning setting must not redo pretraining)."""
        own = self.config["models"][wild(wildcards).model]
        return canonical({k: v for k, v in own.items() if k != "train"})

    # ----------------------------------------------------------------- score.smk
    @property
    def score_shards(self) -> int:
        return int(self.cfg["score"]["shards"])

    def score_inputs(self, wildcards: Any) -> dict:
        """The score rule's model, pool and task items; with shards, the warm-up and every
        shard too (the rule then merges them)."""
        w = wild(wildcards)
        out: dict[str, Any] = {"model": f"results/models/{w.model}/base",
                               "pool": f"results/data/{w.dataset}/pool.jsonl",
                               "task_items": self.target_item_dirs(w)}
        if self.score_shards > 1:
            out["warmup"] = SCORE_WARMUP.format(**vars(w))
            out["shards"] = [SCORE_SHARD.format(**{**vars(w), "shard": i})
                             for i in range(self.score_shards)]
        return out

    def score_warmup_cfg(self, wildcards: Any) -> dict:
        """The score section without `shards`: changing the job count keeps the warm-up."""
        return {k: v for k, v in self.section("score").items() if k != "shards"}

    def length_policy(self, wildcards: Any) -> dict:
        """The model's train max_length / truncation keys (set ones only; with max_length
        auto, its quantile and cap) that score checks the pool against before any gradient
        work."""
        cfg = self.model_train_section(wild(wildcards).model)
        return {k: cfg[k] for k in ("max_length", "truncation", "max_length_quantile",
                                    "max_length_cap") if k in cfg}

    # ----------------------------------------------------------------- cluster.smk
    def cluster_inputs(self, wildcards: Any) -> dict:
        w = wild(wildcards)
        return features_paths(w.dataset, w.model, w.kind, w.seed)

    # ----------------------------------------------------------------- select.smk
    def select_inputs(self, wildcards: Any) -> dict:
        """The clusters of the method's features and that run's scores; the oracle also
        reads the true labels, LESS and RDS+ the features and the tasks' targets."""
        w = wild(wildcards)
        kind = features_of(w.method)
        out = {"clusters": f"results/cluster/{w.dataset}/{w.model}/{kind}/s{w.seed}/"
                           "clusters.parquet",
               "scores": features_paths(w.dataset, w.model, kind, w.seed)["scores"]}
        if w.method == ORACLE:
            out["labels"] = f"results/data/{w.dataset}/labels.parquet"
        if w.method in TARGET_AWARE:
            folder = os.path.dirname(out["scores"])
            out["features"] = f"{folder}/features.npy"
            out["targets"] = f"{folder}/targets.npy"
            out["target_ids"] = f"{folder}/targets.parquet"
        return out

    def select_epochs(self, wildcards: Any) -> int:
        """RS2's per-epoch subsets: as many as the dataset's runs on the model train epochs
        (the model's, or the dataset's own train.epochs)."""
        w = wild(wildcards)
        return int(run_train(self.cfg, w.dataset, w.model)["epochs"]) if w.method == RS2 else 1

    # ----------------------------------------------------------------- train.smk
    def run_train_cfg(self, run: dict) -> str:
        """The model's train section with the dataset's own overrides (JSON) as `run`
        trains; time-only runs train sweep.time.epochs epochs when that is set, and keep no
        model (keep_model: false: nothing evaluates them). An accuracy run's section is the
        model's and dataset's as it is."""
        cfg = self.model_train_section(run["model"], run["dataset"])
        epochs = self.cfg["sweep"]["time"]["epochs"]
        if epochs is not None and self.plan.is_time_only(run):
            cfg = {**cfg, "epochs": int(epochs)}
        if self.plan.is_time_only(run):
            cfg = {**cfg, "keep_model": False}
        if split_dist(run["dist"])[1]:  # the step-matched arm: full data's steps
            cfg = {**cfg, "step_budget": "pool"}
        return json.dumps(canonical(cfg))

    def train_distribution(self, wildcards: Any) -> str:
        """The distribution a train job deals with (its path's, without the step-matched
        arm's suffix)."""
        return split_dist(wild(wildcards).dist)[0]

    def train_cfg(self, wildcards: Any) -> str:
        return self.run_train_cfg(vars(wild(wildcards)))

    def train_seeds_cfg(self, wildcards: Any) -> str:
        """train_cfg of a fused job: the same for every seed (check_config keeps time-only
        runs with their own epochs off the accuracy runs' GPU count)."""
        run = vars(wild(wildcards))
        cfgs = {self.run_train_cfg({**run, "seed": s}) for s in self.plan.seeds}
        if len(cfgs) != 1:
            raise ValueError(f"sweep.accuracy.fuse_seeds: the seeds of {run} would train with "
                             "different settings; set fuse_seeds: false")
        return cfgs.pop()

    @property
    def use_gpu(self) -> bool:
        """Whether jobs ask for GPUs: train.device cuda."""
        return self.cfg["train"]["device"] == "cuda"

    @property
    def score_gpu(self) -> int:
        """GPUs of a job that runs the model in score.smk and features.smk (the warm-up, a
        shard, the one score job, the embeddings): 1 with score.device cuda, or auto where
        training runs on GPUs (train.device: cuda); else 0."""
        device = str(self.cfg["score"]["device"])
        return int(device.startswith("cuda") or (device == "auto" and self.use_gpu))

    def train_launcher(self, wildcards: Any) -> str:
        """One rank: plain `python` (torchrun's launcher process adds seconds per job and
        nothing else: one rank trains without a process group;
        benchmarks/bench_job_overhead.py). More ranks on one node: torchrun --standalone.
        More ranks than the model's train.gpus_per_node: srun + one torchrun agent per
        node, c10d rendezvous (clusterft.pipeline.launch.launcher_shell)."""
        from clusterft.pipeline.launch import launcher_shell

        w = wild(wildcards)
        per_node = self.cfg["model_train"][w.model]["gpus_per_node"]
        return launcher_shell(int(w.gpus), per_node, gpu=self.use_gpu)

    def train_priority(self, wildcards: Any) -> int:
        """Scheduling priority of a train job: its expected work relative to a fused job
        that trains its dataset's full data on the costliest model for the most epochs, in
        percent (pool sizes are not compared across datasets): its share of full data's
        optimiser steps (full data and the step-matched arm 1, a 31% run 0.31) x its epochs
        (a time-only run's sweep.time.epochs) x the seeds the job trains (a fused job all)
        x its model's cost (the most epochs: its dataset's runs', which may set their own,
        as pool sizes). Snakemake starts the ready job of highest priority first, so the
        longest runs start first and short ones fill the other cores beside them
        (longest-processing-time first; the quick target's full-data job otherwise started
        last and ran alone at the end)."""
        from clusterft.pipeline.names import split_dist

        w = wild(wildcards)
        run = {**vars(w), "seed": getattr(w, "seed", self.plan.seeds[0])}
        share = 1.0 if split_dist(w.dist)[1] else min(1.0, float(w.budget))
        epochs = int(self.plan.train_settings(run)["epochs"])
        seeds = 1 if hasattr(w, "seed") else len(self.plan.seeds)
        longest = max(int(run_train(self.plan.cfg, w.dataset, m)["epochs"])
                      for m in self.plan.models)
        work = share * epochs * seeds / (longest * len(self.plan.seeds))
        return max(1, int(round(100 * work * self.model_cost(w.model))))

    def model_cost(self, model: str) -> float:
        """A model's cost per step relative to the config's costliest built model: layers x
        hidden size squared, from models.<name>.size (a size name through the models
        stage's size table; a field a size dict leaves out takes LlamaConfig's default, as
        the built model does); 1 for models of another source (hub models: no size)."""
        from clusterft.stages.models import size_config

        def cost(m: str) -> float | None:
            spec = self.plan.cfg["models"][m] or {}
            if spec.get("source", "build") != "build" or spec.get("size") is None:
                return None
            size = size_config(spec["size"])
            # LlamaConfig's defaults for fields the size leaves out
            return float(size.get("num_hidden_layers", 32)) * float(size.get("hidden_size", 4096)) ** 2

        costs = [c for c in map(cost, self.plan.models) if c]
        own = cost(model)
        return own / max(costs) if own and costs else 1.0

    def train_job(self, wildcards: Any) -> dict:
        """The train job's ranks per node and SLURM resources over nodes, from its GPU
        count and the model's train.gpus_per_node (clusterft.pipeline.launch.job_resources)."""
        from clusterft.pipeline.launch import job_resources

        w = wild(wildcards)
        per_node = self.cfg["model_train"][w.model]["gpus_per_node"]
        return job_resources(int(w.gpus), per_node, gpu=self.use_gpu)

    # ----------------------------------------------------------------- evaluate.smk
    def eval_shard_tasks(self, wildcards: Any) -> list[str]:
        """The tasks of one shard of a run's evaluation."""
        from clusterft.stages.evaluate import shard_tasks

        w = wild(wildcards)
        return shard_tasks(self.eval_tasks(w), int(w.nshards))[int(w.shard)]

    def eval_shards(self, prefix: str) -> Callable[[Any], dict]:
        """Input function: the shard outputs (results.json, raw, items) a run's merge
        reads."""

        def inputs(wildcards: Any) -> dict:
            w = wild(wildcards)
            folder = prefix.format(**vars(w))
            shards = [f"{folder}/shards/{i}-of-{n}"
                      for n in [self.plan.eval_shards(w.dataset)] for i in range(n)]
            return {"shards": [f"{s}/results.json" for s in shards],
                    "shard_raw": [f"{s}/results.lm_eval.json" for s in shards],
                    "shard_items": [f"{s}/items.parquet" for s in shards]}

        return inputs

    # ------------------------------------------------------------------ report.smk
    @functools.cached_property
    def quick_plan(self) -> Sweep:
        """sweep.quick's one-cell view of the plan (`Sweep.quick`), built once for the
        quick_report rule's input and param functions; its InputError, naming the field,
        is raised (and not cached) only when the target is asked for."""
        return self.plan.quick()

    def quick_inputs(self, wildcards: Any = None) -> dict:
        """Input function of quick_report: the report's inputs for the quick cell and the
        overhead benchmarks of its method runs."""
        from clusterft.pipeline.names import CLUSTER

        q = self.quick_plan
        claim = float(self.plan.cfg["report"]["claim_budget"])
        return {**q.report_inputs(), "benchmarks": q.overhead_benchmarks(CLUSTER, claim)}

    def quick_runs(self, wildcards: Any = None) -> list[dict]:
        """Param function of quick_report: the one cell's run records."""
        return self.quick_plan.run_records()

    def quick_clusterings(self, wildcards: Any = None) -> list[dict]:
        """Param function of quick_report: the one cell's clusterings (skill recovery)."""
        return self.quick_plan.cluster_records()

    def quick_labels(self, wildcards: Any = None) -> dict[str, str]:
        """Param function of quick_report: the cell's dataset -> labels.parquet."""
        from clusterft.plan.sweep import LABELS

        return {d: LABELS.format(dataset=d) for d in self.quick_plan.datasets}
