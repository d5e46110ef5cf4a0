"""The sweep as Python: a config's runs, their result paths, the report's inputs and run
records, and every job the workflow's DAG holds (rule and wildcards).

Pure Python (no Snakemake): `workflow/rules/*.smk` build their targets and input functions
from it, and `clusterft.tools.cost` counts its jobs; tests/test_sweep.py checks the job list
against `snakemake -n` on the shipped configs.

    plan = Sweep(cfg)                  # cfg: a config dict (defaults filled in here)
    plan.accuracy_runs, plan.time_runs # dicts: dataset, model, method, budget, gpus, dist, seed
    plan.report_inputs(), plan.run_records(), plan.cluster_records(), plan.report_outputs()
    plan.jobs()                        # [{"rule": ..., "wildcards": {...}}, ...]
    plan.quick()                       # the quick target's one-cell view of the same runs

A run is one training: `dataset`, `model`, `method`, `budget` (its path label,
`budget_label`), `gpus` and `seed` (ints), `dist` (the distribution). The runs:

* accuracy (evaluated), all at sweep.accuracy.gpus: every method of sweep.methods (and of
  sweep.baselines, on its models) at every budget of sweep.budgets (full data at 1), the
  sweep.curve methods at its extra budgets too, the sweep.distribution_ablation methods
  at sweep.budgets with the other distribution, and the sweep.step_matched methods at
  sweep.budgets trained for full data's steps (dist `<distribution>_steps`); every seed;
* time (train metrics only): full data and sweep.time's methods at its budgets, across its
  GPU counts, distributions, seeds and models. A time run equal to an accuracy run is the
  same run (trained once). A run that is only timed keeps no model (train.keep_model
  false: its model folder holds NOT_KEPT.json); nothing takes it as an input.
"""

from __future__ import annotations

import copy
from itertools import product
from typing import Any, Iterable

from clusterft.pipeline.names import (BASE, CLUSTER, FEATURE_KINDS, FULL, GRADIENT, LOSS,
                                      ORACLE, RANDOM, STEPS_SUFFIX, TARGET_AWARE, features_of,
                                      split_dist)
from clusterft.plan.config import budget_label, run_train, settings, tasks_for

RUN = "{dataset}/{model}/{method}-{budget}/g{gpus}-{dist}/s{seed}"
SELECTION = "results/select/{dataset}/{model}/{method}-{budget}/s{seed}/selection.parquet"
CLUSTERS = "results/cluster/{dataset}/{model}/{kind}/s{seed}/clusters.parquet"
LABELS = "results/data/{dataset}/labels.parquet"
BASE_EVAL = "results/eval/{dataset}/{model}/" + BASE + "/{name}"
REPORT_TABLES = ["accuracy_vs_data", "time", "balance_cost", "skill_recovery",
                 "label_counts", "comparisons"]
REPORT_PLOTS = ("accuracy_vs_data", "time", "comparisons")
RUN_KEYS = ("dataset", "model", "method", "budget", "gpus", "dist", "seed")
# The quick target's report (sweep.quick): the same report code over one cell's runs;
# by default these methods, those of them the cell runs (full and the method at least).
QUICK_DIR = "results/quick"
QUICK_METHODS = (FULL, RANDOM, ORACLE, CLUSTER)


def unique(runs: Iterable[dict]) -> list[dict]:
    """`runs` without repeats, in first-seen order."""
    seen, out = set(), []
    for r in runs:
        key = tuple(sorted(r.items()))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def run_path(prefix: str, run: dict, suffix: str) -> str:
    """results/<prefix>/<run>/<suffix>."""
    return f"results/{prefix}/{RUN.format(**run)}/{suffix}"


def selection_path(run: dict) -> str:
    return SELECTION.format(**run)


def features_paths(dataset: str, model: str, kind: str, seed: Any) -> dict[str, str]:
    """features.npy and scores.parquet of one feature kind (the gradient kind is score's)."""
    folder = (f"results/score/{dataset}/{model}/s{seed}" if kind == GRADIENT
              else f"results/features/{dataset}/{model}/{kind}/s{seed}")
    return {"features": f"{folder}/features.npy", "scores": f"{folder}/scores.parquet"}


class Sweep:
    """A config's runs, paths and jobs. `cfg` is a config dict (`clusterft.plan.config.
    settings` fills its defaults; an already settled one is taken as it is)."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg if "model_train" in cfg else settings(cfg)
        cfg = self.cfg
        self.datasets = list(cfg["datasets"])
        self.models = list(cfg["models"])
        # the dataset x model cells: a dataset's `models` (default all) restricts its runs
        self.cells = [(d, m) for d in self.datasets for m in self.models
                      if m in (cfg["datasets"][d].get("models") or self.models)]
        self.seeds = list(cfg["seeds"])
        self.fuse_seeds = bool(cfg["sweep"]["accuracy"]["fuse_seeds"])
        self.seeds_tag = "+".join(str(s) for s in self.seeds)
        self.run_seeds = RUN.replace("s{seed}", f"s{self.seeds_tag}")
        self.accuracy_runs = unique(self._accuracy_runs())
        self.time_runs = unique(self._time_runs())
        self.runs = unique(self.accuracy_runs + self.time_runs)
        self._accuracy_keys = {self.key(r) for r in self.accuracy_runs}

    # ----------------------------------------------------------------- runs
    @staticmethod
    def key(run: dict) -> tuple:
        """A run's identity, whatever the types of its values (wildcards are text)."""
        return (run["dataset"], run["model"], run["method"], str(run["budget"]),
                int(run["gpus"]), run["dist"], int(run["seed"]))

    def in_group(self, group: dict, method: str, model: str, dataset: str) -> bool:
        """Whether an optional sweep group (curve, baselines, distribution_ablation,
        step_matched) covers this method on this model and dataset."""
        return (method in group["methods"] and model in group["models"]
                and dataset in group["datasets"])

    def _accuracy_runs(self) -> Iterable[dict]:
        sweep = self.cfg["sweep"]
        acc, curve = sweep["accuracy"], sweep["curve"]
        baselines, ablation = sweep["baselines"], sweep["distribution_ablation"]
        methods = list(sweep["methods"]) + [m for m in baselines["methods"]
                                            if m not in sweep["methods"]]
        for (dataset, model), seed, method in product(self.cells, self.seeds, methods):
            if (method not in sweep["methods"]
                    and not self.in_group(baselines, method, model, dataset)):
                continue
            budgets = list(sweep["budgets"])
            if self.in_group(curve, method, model, dataset):
                budgets += [b for b in curve["budgets"] if b not in budgets]
            dists = [acc["distribution"]]
            if self.in_group(ablation, method, model, dataset):
                dists.append(ablation["distribution"])
            for budget, dist in product([1.0] if method == FULL else sorted(budgets), dists):
                if dist != acc["distribution"] and budget not in sweep["budgets"]:
                    continue
                yield dict(dataset=dataset, model=model, method=method,
                           budget=budget_label(budget), gpus=acc["gpus"], dist=dist, seed=seed)
        matched = sweep["step_matched"]
        for (dataset, model), seed, method in product(self.cells, self.seeds,
                                                      matched["methods"]):
            if not self.in_group(matched, method, model, dataset):
                continue
            for budget in [1.0] if method == FULL else sorted(sweep["budgets"]):
                yield dict(dataset=dataset, model=model, method=method,
                           budget=budget_label(budget), gpus=acc["gpus"],
                           dist=acc["distribution"] + STEPS_SUFFIX, seed=seed)

    def _time_runs(self) -> Iterable[dict]:
        t = self.cfg["sweep"]["time"]
        for (dataset, model), seed, gpus, dist in product(self.cells, t["seeds"], t["gpus"],
                                                          t["distributions"]):
            if model not in t["models"] or dataset not in t["datasets"]:
                continue
            run = dict(dataset=dataset, model=model, gpus=gpus, dist=dist, seed=seed)
            yield dict(run, method=FULL, budget=budget_label(1.0))
            for method, budget in product(t["methods"], t["budgets"]):
                yield dict(run, method=method, budget=budget_label(1.0 if method == FULL
                                                                    else budget))

    def is_accuracy(self, run: dict) -> bool:
        return self.key(run) in self._accuracy_keys

    def is_time_only(self, run: dict) -> bool:
        """A run that is not one of the accuracy runs (it trains sweep.time.epochs epochs
        when that is set)."""
        return not self.is_accuracy(run)

    def fused(self, run: dict) -> bool:
        """Whether a run's train and evaluate jobs are the fused ones of its seeds
        (sweep.accuracy.fuse_seeds: one-GPU runs of the config's seeds)."""
        return (self.fuse_seeds and int(run["gpus"]) == 1
                and int(run["seed"]) in [int(s) for s in self.seeds])

    def train_benchmark(self, run: dict) -> str:
        """The benchmark file of the job that trained `run` (fused: its seeds' one)."""
        return f"benchmarks/out/train/{(self.run_seeds if self.fused(run) else RUN).format(**run)}.tsv"

    # ----------------------------------------------------------------- report
    def run_role(self, run: dict, with_eval: bool) -> str:
        """accuracy, ablation (an accuracy run with the other distribution), step_matched
        (sweep.step_matched: trained for full data's steps) or time."""
        if not with_eval:
            return "time"
        if split_dist(run["dist"])[1]:
            return "step_matched"
        main = self.cfg["sweep"]["accuracy"]["distribution"]
        return "accuracy" if run["dist"] == main else "ablation"

    def run_record(self, run: dict, with_eval: bool) -> dict:
        """One run of the report's run table: its keys and the result files it reads."""
        return {
            **{k: run[k] for k in ("dataset", "model", "method", "budget", "gpus", "seed")},
            "distribution": run["dist"],
            "role": self.run_role(run, with_eval),
            "eval_json": run_path("eval", run, "results.json") if with_eval else None,
            "items": run_path("eval", run, "items.parquet") if with_eval else None,
            "selection": selection_path(run) if run["method"] != FULL else None,
            "train_metrics_json": run_path("train", run, "train_metrics.json"),
        }

    def run_records(self) -> list[dict]:
        """Every run the report reads: the accuracy runs (evaluated), the time-only runs
        (train metrics only) and each base model's evaluation (no training)."""
        runs = [self.run_record(r, True) for r in self.accuracy_runs]
        runs += [self.run_record(r, False) for r in self.time_runs if not self.is_accuracy(r)]
        runs += [{"dataset": d, "model": m, "method": BASE, "budget": 0.0, "seed": 0,
                  "eval_json": BASE_EVAL.format(dataset=d, model=m, name="results.json"),
                  "items": BASE_EVAL.format(dataset=d, model=m, name="items.parquet")}
                 for d, m in self.cells]
        return runs

    def cluster_records(self) -> list[dict]:
        """Every feature kind's clusters per dataset, model and seed, for the skill-recovery
        table (the method never reads the labels; the report does)."""
        return [{"dataset": d, "model": m, "seed": s, "features": k,
                 "clusters": CLUSTERS.format(dataset=d, model=m, kind=k, seed=s),
                 "labels": LABELS.format(dataset=d)}
                for (d, m), s, k in product(self.cells, self.seeds, FEATURE_KINDS)]

    def report_inputs(self) -> dict[str, list[str]]:
        """The report rule's named inputs (its benchmarks: `overhead_benchmarks`)."""
        acc = self.accuracy_runs
        return dict(
            evals=[run_path("eval", r, "results.json") for r in acc],
            base_evals=[BASE_EVAL.format(dataset=d, model=m, name="results.json")
                        for d, m in self.cells],
            metrics=[run_path("train", r, "train_metrics.json") for r in self.runs],
            per_item=[run_path("eval", r, "items.parquet") for r in acc],
            selections=sorted({selection_path(r) for r in acc if r["method"] != FULL}),
            clusters=[c["clusters"] for c in self.cluster_records()],
            labels=[LABELS.format(dataset=d) for d in self.datasets],
        )

    # ----------------------------------------------------------------- quick target
    def quick_cell(self) -> tuple[str, str]:
        """sweep.quick's dataset and model: by default the first testbed (a dataset with
        `source: cipher`, where the positive control is), else the first dataset; its first
        model."""
        from clusterft.pipeline.errors import InputError

        q = self.cfg["sweep"].get("quick") or {}
        sources = {d: (self.cfg["datasets"][d] or {}).get("source", d) for d in self.datasets}
        dataset = q.get("dataset") or next((d for d in self.datasets if sources[d] == "cipher"),
                                           self.datasets[0])
        models = [m for d, m in self.cells if d == dataset]
        if dataset not in self.datasets or not models:
            raise InputError(f"dataset '{dataset}' has no runs in this sweep; runs are planned "
                             f"for {', '.join(dict.fromkeys(d for d, _ in self.cells))}",
                             field="sweep.quick.dataset")
        model = q.get("model") or models[0]
        if model not in models:
            raise InputError(f"model '{model}' has no runs on {dataset}; its models: "
                             f"{', '.join(models)}", field="sweep.quick.model")
        return dataset, model

    def quick(self) -> "Sweep":
        """The quick target's view of this sweep: one cell (`quick_cell`), sweep.quick's
        methods at the claim budget (full data at 1) under the accuracy runs' distribution,
        every seed. The SAME runs, paths and jobs as the whole sweep (a sub-DAG, so a later
        full run reuses all of it); its report, from the same code, goes to results/quick.
        InputError (field sweep.quick.methods) for a method the sweep does not run there."""
        from clusterft.pipeline.errors import InputError

        dataset, model = self.quick_cell()
        q = self.cfg["sweep"].get("quick") or {}
        given = q.get("methods")
        methods = list(given or QUICK_METHODS)
        claim = budget_label(float(self.cfg["report"]["claim_budget"]))
        dist = self.cfg["sweep"]["accuracy"]["distribution"]

        def wanted(r: dict) -> bool:
            return (r["dataset"] == dataset and r["model"] == model and r["dist"] == dist
                    and r["method"] in methods
                    and r["budget"] == (budget_label(1.0) if r["method"] == FULL else claim))

        runs = [r for r in self.accuracy_runs if wanted(r)]
        if not any(r["dataset"] == dataset and r["model"] == model and r["budget"] == claim
                   for r in self.accuracy_runs):
            raise InputError(f"the claim budget {claim} is not a budget of this sweep "
                             "(sweep.budgets); the quick target runs the claim's comparisons",
                             field="report.claim_budget")
        missing = [m for m in methods if not any(r["method"] == m for r in runs)]
        if given is None:  # the default: what the cell runs of QUICK_METHODS, full and the
            missing = [m for m in (FULL, CLUSTER) if m in missing]  # method at least
        if missing or not methods:
            raise InputError(
                f"{', '.join(missing) or 'no method'}: not run on {dataset}/{model} at the claim "
                f"budget {claim} in this sweep; list methods of sweep.methods (or of "
                "sweep.baselines on this cell)", field="sweep.quick.methods")
        view = copy.copy(self)
        view.datasets, view.models, view.cells = [dataset], [model], [(dataset, model)]
        view.accuracy_runs = runs
        view.time_runs = []
        view.runs = list(runs)
        view._accuracy_keys = {self.key(r) for r in runs}
        return view

    def quick_outputs(self) -> list[str]:
        """What the quick target asks for: its claims, findings and skill recovery."""
        return [f"{QUICK_DIR}/tables/claims.md", f"{QUICK_DIR}/tables/findings.md",
                f"{QUICK_DIR}/tables/skill_recovery.md", f"{QUICK_DIR}/plots"]

    def report_outputs(self) -> list[str]:
        return ([f"results/tables/{t}.{ext}" for t in REPORT_TABLES for ext in ("csv", "md")]
                + ["results/tables/findings.md", "results/tables/claims.md"]
                + [f"results/plots/{p}_{d}.png" for p in REPORT_PLOTS for d in self.datasets]
                + ["results/plots/skill_recovery.png"])

    def overhead_benchmarks(self, method: str, budget: float) -> list[str]:
        """The `benchmark:` files selection_overhead reads: `method`'s score, cluster, select
        and train jobs at `budget` and the full-data train jobs beside them."""
        label = budget_label(budget)
        keys = {self.key(r) for r in self.runs}
        out = set()
        for r in self.runs:
            full = {**r, "method": FULL, "budget": budget_label(1.0)}
            if r["method"] != method or r["budget"] != label or self.key(full) not in keys:
                continue
            out |= {self.train_benchmark(r), self.train_benchmark(full),
                    "benchmarks/out/score/{dataset}/{model}/s{seed}.tsv".format(**r),
                    "benchmarks/out/cluster/{dataset}/{model}/gradient/s{seed}.tsv".format(**r),
                    "benchmarks/out/select/{dataset}/{model}/{method}-{budget}/s{seed}.tsv"
                    .format(**r)}
        return sorted(out)

    # ----------------------------------------------------------------- train settings
    def train_settings(self, run: dict) -> dict:
        """The model's train section (its own overrides merged, DEFAULTS under them, the
        run's dataset's own epochs / lr over them: `run_train`) as `run` trains: time-only
        runs train sweep.time.epochs epochs when that is set, and keep no model (keep_model
        false: their folder holds only NOT_KEPT.json)."""
        cfg = run_train(self.cfg, run["dataset"], run["model"])
        epochs = self.cfg["sweep"]["time"]["epochs"]
        if epochs is not None and self.is_time_only(run):
            cfg["epochs"] = int(epochs)
        if self.is_time_only(run):
            cfg["keep_model"] = False
        return cfg

    # ----------------------------------------------------------------- jobs
    def eval_shards(self, dataset: str) -> int:
        """Jobs one evaluation of `dataset` is split into (evaluate.shards, at most one per
        task: clusterft.stages.evaluate.shard_tasks)."""
        from clusterft.stages.evaluate import shard_tasks

        return len(shard_tasks(tasks_for(self.cfg, dataset), self.cfg["evaluate"]["shards"]))

    def jobs(self) -> list[dict]:
        """Every job of the workflow's DAG for this config (what `snakemake -n -F` lists):
        {"rule", "wildcards"} with the wildcards as text, in the order of the output path."""
        out: list[dict] = []

        def job(rule: str, **wildcards: Any) -> None:
            out.append({"rule": rule, "wildcards": {k: str(v) for k, v in wildcards.items()}})

        cfg, seeds = self.cfg, [int(s) for s in self.seeds]
        score_shards = int(cfg["score"]["shards"])
        eval_sharded = int(cfg["evaluate"]["shards"]) > 1
        from clusterft.stages.download import needs_download

        if needs_download(cfg):  # models, hub pools, lm-eval data from outside the run
            job("download")
        for d in self.datasets:
            job("prepare_data", dataset=d)
        if cfg["tasks"].get("lm_eval_tasks"):  # the named lm-eval tasks' items
            job("benchmark_docs")
        for d in self.datasets:
            job("decontaminate", dataset=d)
        job("contamination_table")
        job("corpus")
        job("tokenizer")
        for m in self.models:
            job("base_model", model=m)

        # training: a fused job trains every seed of its run (and needs their selections)
        trained, fused = [], []
        for r in self.runs:
            if self.fused(r):
                fused.append({k: r[k] for k in RUN_KEYS if k != "seed"})
                trained += [{**r, "seed": s} for s in seeds]
            else:
                trained.append(r)
        fused, trained = unique(fused), unique(trained)
        selections = unique({k: r[k] for k in ("dataset", "model", "method", "budget", "seed")}
                            for r in trained)
        # features and clusters: every kind for the report, and what each selection reads
        clusters = [dict(dataset=d, model=m, kind=k, seed=s)
                    for (d, m), s, k in product(self.cells, self.seeds, FEATURE_KINDS)]
        features = []
        for s in selections:
            kind = features_of(s["method"])
            clusters.append(dict(dataset=s["dataset"], model=s["model"], kind=kind,
                                 seed=s["seed"]))
            if s["method"] in TARGET_AWARE:
                features.append(dict(dataset=s["dataset"], model=s["model"], kind=kind,
                                     seed=s["seed"]))
        clusters = unique({**c, "seed": int(c["seed"])} for c in clusters)
        features = unique([*({**c, "seed": int(c["seed"])} for c in features),
                           *clusters])
        kinds = {(c["dataset"], c["model"], c["seed"], c["kind"]) for c in features}
        if any(k == LOSS for *_, k in kinds):  # loss features read the score run's outputs
            kinds |= {(d, m, s, GRADIENT) for d, m, s, k in kinds if k == LOSS}
        for d, m, s, kind in sorted(kinds, key=lambda x: (FEATURE_KINDS.index(x[3]), x[:3])):
            if kind == GRADIENT:
                if score_shards > 1:
                    job("score_warmup", dataset=d, model=m, seed=s)
                    for i in range(score_shards):
                        job("score_shard", dataset=d, model=m, seed=s, shard=i)
                job("score", dataset=d, model=m, seed=s)
            else:
                job(f"{kind}_features", dataset=d, model=m, seed=s)
        for c in clusters:
            job("cluster", **c)
        for s in selections:
            job("select", **s)
        for r in fused:
            job("train_seeds", **r)
        for r in trained:
            if not self.fused(r):
                job("train", **{k: r[k] for k in RUN_KEYS})

        # evaluation: the accuracy runs and each base model
        evals = [("evaluate_base", dict(dataset=d, model=m))
                 for d, m in self.cells]
        seed_evals = unique({k: r[k] for k in RUN_KEYS if k != "seed"}
                            for r in self.accuracy_runs if self.fused(r))
        if self.fuse_seeds and not eval_sharded:
            for r in seed_evals:
                job("evaluate_seeds", **r)
        for r in self.accuracy_runs:
            if not (self.fuse_seeds and not eval_sharded and self.fused(r)):
                evals.append(("evaluate", {k: r[k] for k in RUN_KEYS}))
        for rule, w in evals:
            if eval_sharded:
                n = self.eval_shards(w["dataset"])
                for i in range(n):
                    job(f"{rule}_shard", **w, shard=i, nshards=n)
            job(rule, **w)
        job("report")
        job("all")
        return out
