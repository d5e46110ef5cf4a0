"""Cost table before submitting: GPU-hours and disk per rule and in total for a config's
every job.

    python -m clusterft.tools.cost --config config/paper.yaml [--out results/tables/cost]
        [--tokens-per-example DATASET=N ...] [--params MODEL=N ...] [--mfu 0.3]

The jobs are the workflow's own: ``clusterft.plan.sweep.Sweep.jobs`` lists every job's rule
and wildcards from the config, the same sweep expansion the Snakefile builds its DAG from
(no snakemake run; tests/test_sweep.py and tests/test_cost.py check the list against
``snakemake -n -F --configfile CONFIG``, whose printout ``dry_run_jobs`` still reads).
Each job's work is then estimated with ``clusterft.analysis.costmodel`` (its module docstring states
the assumptions: FLOPs per token, utilisation, fixed per-step cost):

* ``train``: the sampler's real token plan (``costmodel.token_plan``, what train deals) of
  one epoch of a seeded stand-in pool (log-normal lengths with the dataset's mean
  tokens per example and sigma ``LENGTH_SIGMA``, capped at train's ``max_length``; Zipf
  clusters, ``cluster.k``) at the run's GPU count, distribution and per-rank batch gives the
  mean step time; times the run's steps (epochs x ceil(selected / global batch)); GPU-hours
  = that wall time x the run's GPUs (idle waits of the faster ranks included).
  ``train.gradient_checkpointing`` adds a forward pass per token; FSDP's and multi-node
  communication are not modelled (assumed hidden behind compute).
* ``score`` (or ``score_warmup`` + ``score_shard`` with ``score.shards``): the warm-up
  (``warmup_fraction`` x ``warmup_epochs`` of the pool, or ``warmup_steps`` batches, at the
  LoRA training cost), one gradient pass per warm-up checkpoint (forward + backward, LoRA
  cost) and ``loss_points`` forward passes, over the pool's tokens capped at
  ``score.max_length``, and each pass's projection of the LoRA gradients
  (``costmodel.projection_work``: dense projections multiply by and regenerate a D x dim
  matrix per batch, hours per pass at 7B; kronecker costs a small fraction of the forward
  pass); one GPU.
* ``embedding_features``: one forward pass over the pool (``features.max_length``).
* ``evaluate`` / ``evaluate_base`` (or their ``_shard`` jobs): per task, ``EVAL_TASKS``'s
  documented estimate of its items and tokens (forward passes; generated tokens cost
  ``DECODE_PENALTY`` forward tokens each: decoding is memory-bound); unknown tasks get
  ``EVAL_DEFAULT``.
* every other rule (data, tokenizer, clustering, selection, merges, report; base models
  from the hub): no GPU work, 0 GPU-hours.

A ``max_length: auto`` (clusterft.modeling.lengths) is resolved on the stand-in pool's
log-normal lengths (``Estimator.max_length``); ``Estimator.job_seconds`` is one job's
estimate, which the workflow's runtimes also start from (clusterft.plan.resources).

Tokens per example of a hub dataset are unknown before download: ``TOKENS_PER_EXAMPLE``
holds documented estimates per hub dataset id (override per dataset with
``--tokens-per-example NAME=N``); a dataset with neither stops the command, naming it.
Parameter counts: ``costmodel.KNOWN_PARAMS`` for hub ids, the architecture for models the
workflow builds, else ``--params NAME=N``. Disk: the models, LoRA adapters and feature
matrices each job leaves in results/ (``Estimator.disk_bytes``; a train job that is only
timed keeps no model, 0). Writes ``<out>.csv`` (one row per rule plus the
total), ``<out>.md`` (the same table, with the assumptions) and ``<out>_jobs.csv`` (one row
per job); each file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from clusterft.analysis.costmodel import (DEFAULT_MFU, DEFAULT_STEP_OVERHEAD_S, H100_BF16_FLOPS,
                                          DRAWS_PER_SECOND, KNOWN_CONFIGS, KNOWN_PARAMS, CostModel,
                                          flops_per_token, lora_matrices, projection_work,
                                          token_plan)
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.names import STEPS_SUFFIX

ROOT = Path(__file__).resolve().parents[3]

# Mean tokens per example (prompt + response, Llama-2 tokenizer) of the hub datasets
# config/paper.yaml names: our estimates from the datasets' cards and a few hundred rows'
# character counts at ~3.5 characters per token, to be replaced by the measured mean once
# the pools exist (prepare_data's summary). Within a factor of ~1.5.
TOKENS_PER_EXAMPLE = {
    "sahil2801/CodeAlpaca-20k": 100,                    # short instructions, short snippets
    "ise-uiuc/Magicoder-OSS-Instruct-75K": 450,         # problem statement + full solution
    "medalpaca/medical_meadow_medical_flashcards": 90,  # one question, one short answer
}
LENGTH_SIGMA = 0.8   # log-normal sigma of the stand-in pool's lengths (assumed)
SIM_EXAMPLES = 4096  # examples of the stand-in pool a train plan is simulated on
# lm-eval tasks: (items, forward tokens per item over all its requests, generated tokens
# per item). Items: the tasks' evaluation splits (MMLU subjects' test sets, MedQA 4-option
# test, MedMCQA validation, HumanEval, MBPP test). Tokens: our
# estimates, 0-shot, every answer choice scored as its own request with its context.
EVAL_TASKS = {
    "humaneval": (164, 200, 512),
    "mbpp": (500, 600, 256),
    "mmlu_college_computer_science": (100, 4 * 200, 0),
    "medqa_4options": (1273, 4 * 250, 0),
    "medmcqa": (4183, 4 * 80, 0),
    "mmlu_college_medicine": (173, 4 * 200, 0),
    "mmlu_clinical_knowledge": (265, 4 * 100, 0),
    "mmlu_professional_medicine": (272, 4 * 350, 0),
}
EVAL_DEFAULT = (1000, 1024, 0)  # a task not listed above (and the repo-defined tasks)
DECODE_PENALTY = 10.0  # a generated token costs this many forward tokens (memory-bound)
CPU_RULES_NOTE = "no GPU work"


# ----------------------------------------------------------------------------- jobs
def plan_jobs(cfg: dict) -> list[dict]:
    """Every job of the workflow for config `cfg` (``clusterft.plan.sweep``): rule and
    wildcards (as text, in the order of the rule's output path)."""
    from clusterft.plan.sweep import Sweep

    return Sweep(cfg).jobs()


def dry_run_jobs(config: str | os.PathLike, snakefile: str | os.PathLike | None = None,
                 workdir: str | os.PathLike | None = None) -> list[dict]:
    """Every job of ``snakemake -n -F --configfile config``: rule, wildcards, resources
    (the independent check of ``plan_jobs``).

    Checked against the dry run's own per-rule job counts ("Job stats")."""
    snakefile = Path(snakefile or ROOT / "Snakefile")
    cmd = [sys.executable, "-m", "snakemake", "-n", "-F",
           "--configfile", str(Path(config).resolve()),
           "--snakefile", str(snakefile), "--directory", str(workdir or snakefile.parent)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise InputError(f"the workflow's dry run failed:\n{(out.stderr or out.stdout)[-3000:]}",
                         path=str(config))
    return parse_dry_run(out.stdout + "\n" + out.stderr)


def parse_dry_run(text: str) -> list[dict]:
    """Jobs of a ``snakemake -n`` printout (blocks opened by ``rule NAME:``)."""
    jobs: list[dict] = []
    cur: dict | None = None
    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):\s*$", line)
        if m:
            cur = {"rule": m.group(1), "wildcards": {}, "resources": {}}
            jobs.append(cur)
            continue
        if cur is None:
            continue
        m = re.match(r"^\s+(wildcards|resources): (.*)$", line)
        if m:
            for part in m.group(2).split(", "):
                k, _, v = part.partition("=")
                cur[m.group(1)][k.strip()] = v.strip()
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j["rule"]] = counts.get(j["rule"], 0) + 1
    stats = job_stats(text)
    if stats != counts:
        raise RuntimeError(f"dry run: {counts} jobs parsed, but its job stats say {stats}")
    return jobs


def job_stats(text: str) -> dict[str, int]:
    """The per-rule counts of the dry run's last "Job stats" table (without ``total``)."""
    blocks = text.split("Job stats:")
    if len(blocks) < 2:
        raise RuntimeError("no 'Job stats' table in the dry run's output")
    counts = {}
    for line in blocks[-1].splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line)
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
        elif counts and not line.strip():
            break
    return counts


# ----------------------------------------------------------------------------- inputs
def _pairs(items: list[str] | None, what: str) -> dict[str, float]:
    out = {}
    for it in items or []:
        name, sep, val = it.partition("=")
        try:
            out[name] = float(val)
            ok = bool(sep) and out[name] > 0
        except ValueError:
            ok = False
        if not ok:
            raise InputError(f"{what} must be NAME=POSITIVE_NUMBER, got {it!r}",
                             field=f"--{what}")
    return out


def tokens_per_example(cfg: dict, overrides: dict[str, float], source: str) -> dict[str, float]:
    """Mean tokens per example of each dataset: override, else the dataset's
    ``tokens_per_example`` key, else TOKENS_PER_EXAMPLE by hub id; else an error."""
    out = {}
    for name, d in cfg["datasets"].items():
        v = overrides.get(name, d.get("tokens_per_example"))
        if v is None:
            v = TOKENS_PER_EXAMPLE.get(d.get("hf_dataset", ""))
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise InputError(f"no estimate of tokens per example for dataset '{name}' "
                             f"(got {v!r}); pass --tokens-per-example {name}=N", path=source,
                             field=f"datasets.{name}")
        out[name] = float(v)
    return out


def model_params(cfg: dict, overrides: dict[str, float], source: str) -> dict[str, float]:
    """Parameter count of each model: override, KNOWN_PARAMS by hub id, or the built
    architecture (counted on the meta device); else an error naming the model."""
    out = {}
    for name, m in cfg["models"].items():
        v = overrides.get(name) or KNOWN_PARAMS.get(m.get("hub_id", ""))
        if v is None and m.get("source") == "build":
            v = _built_params(m)
        if v is None:
            raise InputError(f"parameter count of model '{name}' unknown; pass --params {name}=N",
                             path=source, field=f"models.{name}")
        out[name] = float(v)
    return out


def model_configs(cfg: dict) -> dict[str, dict | None]:
    """Each model's architecture (hidden size, layers, ...): KNOWN_CONFIGS by hub id, or the
    size of a model the workflow builds; None where unknown (then neither the projection nor
    an adapter's size is estimated, and the table says so)."""
    from clusterft.stages.models import DEFAULTS, size_config

    out: dict[str, dict | None] = {}
    for name, m in cfg["models"].items():
        if m.get("hub_id") in KNOWN_CONFIGS:
            out[name] = KNOWN_CONFIGS[m["hub_id"]]
        elif m.get("source", "build") == "build":
            out[name] = {"vocab_size": DEFAULTS["vocab_size"], **size_config(m.get("size", name))}
        else:
            out[name] = None
    return out


def _built_params(m: dict) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from clusterft.stages.models import DEFAULTS, size_config

    fields = size_config(m.get("size", "small"))
    fields.setdefault("vocab_size", DEFAULTS["vocab_size"])
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    return float(sum(p.numel() for p in model.parameters()))


# ----------------------------------------------------------------------------- estimates
class Estimator:
    """Seconds and GPUs of each job of a config (see the module docstring)."""

    def __init__(self, cfg: dict, tpe: dict[str, float], params: dict[str, float],
                 peak_flops: float = H100_BF16_FLOPS, mfu: float = DEFAULT_MFU,
                 step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
                 length_sigma: float = LENGTH_SIGMA) -> None:
        from clusterft.plan.config import settings

        # every section over its stage's DEFAULTS (clusterft.plan.config.settings)
        cfg = cfg if "model_train" in cfg else settings(cfg)
        self.cfg, self.tpe, self.params = cfg, tpe, params
        self.peak, self.mfu = peak_flops, mfu
        self.overhead, self.sigma = step_overhead_s, length_sigma
        self.score, self.features = cfg["score"], cfg["features"]
        self.train = cfg["model_train"]
        self.configs = model_configs(cfg)
        self._plans: dict = {}

    def max_length(self, section: dict, ds: str, model: str) -> int:
        """A section's max_length; ``auto`` (clusterft.modeling.lengths) resolved on the
        stand-in length distribution: its max_length_quantile quantile (log-normal, the
        dataset's mean tokens, sigma LENGTH_SIGMA), rounded up to a multiple of 64, at most
        max_length_cap and the model's context where known."""
        from statistics import NormalDist

        from clusterft.modeling.lengths import DEFAULT_CAP, DEFAULT_QUANTILE, MULTIPLE, is_auto

        if not is_auto(section["max_length"]):
            return int(section["max_length"])
        q = float(section.get("max_length_quantile", DEFAULT_QUANTILE))
        mu = math.log(self.tpe[ds]) - self.sigma ** 2 / 2
        z = NormalDist().inv_cdf(q) if q < 1 else 4.0  # q = 1: the longest of ~10^4-10^5
        tokens = math.exp(mu + self.sigma * z)
        cap = int(section.get("max_length_cap", DEFAULT_CAP))
        context = (self.configs.get(model) or {}).get("max_position_embeddings")
        return min(MULTIPLE * math.ceil(tokens / MULTIPLE), cap, int(context or cap))

    def flop_seconds(self, model: str, tokens: float, kind: str) -> float:
        return tokens * flops_per_token(self.params[model], kind) / (self.peak * self.mfu)

    def pool(self, dataset: str) -> int:
        return int(self.cfg["datasets"][dataset].get("n") or 0)

    # train ------------------------------------------------------------------
    def train_seconds(self, w: dict, evaluated: bool) -> float:
        from clusterft.plan.config import run_train
        from clusterft.stages.train import rank_batch_size

        ds, model, gpus = w["dataset"], w["model"], int(w["gpus"])
        tcfg = run_train(self.cfg, ds, model)  # the dataset's own epochs where it sets them
        epochs = int(tcfg["epochs"])
        time_epochs = self.cfg["sweep"]["time"]["epochs"]
        if time_epochs is not None and not evaluated:
            epochs = int(time_epochs)
        # the step-matched arm (dist <distribution>_steps) trains full data's steps
        fraction = 1.0 if str(w.get("dist", "")).endswith(STEPS_SUFFIX) else float(w["budget"])
        n_sel = max(1, round(fraction * self.pool(ds)))
        bs = rank_batch_size(tcfg, gpus)
        steps = epochs * math.ceil(n_sel / (bs * gpus))
        return steps * self.mean_step_seconds(ds, model, gpus, w["dist"], bs, n_sel)

    def mean_step_seconds(self, ds: str, model: str, gpus: int, dist: str, bs: int,
                          n_sel: int) -> float:
        tcfg = self.train[model]
        n = min(n_sel, SIM_EXAMPLES)
        key = (ds, model, gpus, dist, bs, n)
        if key not in self._plans:
            rng = np.random.default_rng(0)
            k = max(1, int(self.cfg["cluster"]["k"]))
            w = 1.0 / np.arange(1, k + 1)
            clusters = rng.choice(k, size=n, p=w / w.sum())
            mu = math.log(self.tpe[ds]) - self.sigma ** 2 / 2
            lengths = np.clip(np.round(rng.lognormal(mu, self.sigma, n)), 1,
                              self.max_length(tcfg, ds, model)).astype(np.int64)
            padded, _ = token_plan(dist, clusters, lengths, gpus, bs, 0, 1,
                                   bool(tcfg["drop_last"]), float(tcfg["group_cost_tokens"]),
                                   int(tcfg["pad_to_multiple_of"]))
            kind = "full" if tcfg["finetune"] == "full" else "lora"
            flops = flops_per_token(self.params[model], kind,
                                    bool(tcfg["gradient_checkpointing"]))
            cm = CostModel(flops / (self.peak * self.mfu), self.overhead)
            self._plans[key] = float(cm.step_times(padded).mean())
        return self._plans[key]

    # score, features, evaluate ---------------------------------------------
    def score_parts(self, ds: str, model: str) -> tuple[float, float]:
        """(warm-up seconds, gradient + loss-trajectory seconds) of one score run."""
        s = self.score
        per_ex = min(self.tpe[ds], float(self.max_length(s, ds, model)))
        n = self.pool(ds)
        if s.get("warmup_steps") is not None:
            warm_ex = int(s["warmup_steps"]) * int(s["batch_size"])
        else:
            warm_ex = float(s["warmup_fraction"]) * n * int(s["warmup_epochs"])
        warm = self.flop_seconds(model, warm_ex * per_ex, "lora")
        ckpts = int(s["warmup_checkpoints"])
        grads = self.flop_seconds(model, ckpts * n * per_ex, "lora")
        losses = self.flop_seconds(model, int(s["loss_points"]) * n * per_ex, "forward")
        return warm, grads + losses + ckpts * self.projection_seconds(ds, model)

    def projection_seconds(self, ds: str, model: str) -> float:
        """One gradient pass's projection (costmodel.projection_work: its FLOPs at the
        training utilisation, a dense matrix's draws at DRAWS_PER_SECOND); 0 where the
        model's architecture is unknown."""
        config, s = self.configs.get(model), self.score
        if config is None:
            return 0.0
        n = self.pool(ds)
        per_ex = min(self.tpe[ds], float(self.max_length(s, ds, model)))
        flops, draws = projection_work(lora_matrices(config, s["lora"]), int(s["dim"]),
                                       s["projection"], n * per_ex, n,
                                       math.ceil(n / int(s["batch_size"])))
        return flops / (self.peak * self.mfu) + draws / DRAWS_PER_SECOND

    # disk --------------------------------------------------------------------
    def disk_bytes(self, rule: str, w: dict) -> float:
        """Bytes a job leaves in results/: models, adapters and feature matrices (tables,
        selections and logs are small and not counted)."""
        model, ds = w.get("model"), w.get("dataset")
        if rule in ("train", "train_seeds"):
            t = self.train[model]
            seeds = len(self.cfg["seeds"]) if rule == "train_seeds" else 1
            config = self.configs.get(model)
            if t["finetune"] == "lora" and not t["merge_lora"]:
                if config is None:
                    return 0.0
                return seeds * 4.0 * sum(i * o for i, o in lora_matrices(config, t["lora"]))
            bf16 = t["finetune"] == "lora" and t["device"] == "cuda" and t["precision"] != "fp32"
            return seeds * self.params[model] * (2 if bf16 else 4)
        if rule == "base_model":
            hub = self.cfg["models"][model].get("source") == "hub"
            return self.params[model] * (2 if hub else 4)  # hub checkpoints: their fp16/bf16
        if rule in ("score", "score_shard"):  # the merge's files; each shard holds its rows
            s = self.score
            width = int(s["dim"]) * int(s["warmup_checkpoints"]) + int(s["loss_points"])
            shards = int(s["shards"]) if rule == "score_shard" else 1
            return 4.0 * self.pool(ds) * width / shards
        if rule == "embedding_features":
            config = self.configs.get(model)
            return 4.0 * self.pool(ds) * (config["hidden_size"] if config else 0)
        if rule == "tfidf_features":
            return 4.0 * self.pool(ds) * int(self.features["dim"])
        return 0.0

    def embedding_seconds(self, ds: str, model: str) -> float:
        per_ex = min(self.tpe[ds], float(self.max_length(self.features, ds, model)))
        return self.flop_seconds(model, self.pool(ds) * per_ex, "forward")

    # one job -----------------------------------------------------------------
    def job_seconds(self, rule: str, w: dict, merged: bool = False) -> tuple[int, float, str]:
        """(GPUs, seconds, note) of one job of ``rule`` with wildcards ``w`` (text or
        numbers). ``merged``: for score and evaluate, a job that merges its shards' outputs
        (no GPU work); for train, a time-only run (it trains sweep.time.epochs epochs where
        that is set). Rules without GPU work: (0, 0.0, CPU_RULES_NOTE). A dataset or model
        the estimator has no numbers for raises KeyError."""
        from clusterft.plan.config import tasks_for

        n_seeds = len(self.cfg["seeds"])
        if rule == "train":
            gpus = int(w["gpus"])
            return (gpus, self.train_seconds(w, not merged),
                    f"{w['dist']} deal over {gpus} GPUs")
        if rule == "train_seeds":  # sweep.accuracy.fuse_seeds: every seed, one GPU
            return (int(w["gpus"]), n_seeds * self.train_seconds(w, True),
                    f"{n_seeds} seeds one after the other")
        if rule in ("score", "score_warmup", "score_shard"):
            warm, rest = self.score_parts(w["dataset"], w["model"])
            shards = int(self.score["shards"])
            if rule == "score_warmup":
                return 1, warm, "warm-up"
            if rule == "score_shard":
                return 1, rest / shards, f"1/{shards} of the gradient pass"
            if merged:
                return 0, 0.0, "merge of the shards"
            return 1, warm + rest, "warm-up + gradient pass"
        if rule == "embedding_features":
            return 1, self.embedding_seconds(w["dataset"], w["model"]), "forward pass"
        if rule.startswith("evaluate"):
            tasks = tasks_for(self.cfg, w["dataset"])
            if "shard" in w and "nshards" in w:
                tasks = _shard_tasks(tasks, int(w["nshards"]))[int(w["shard"])]
            elif merged:
                tasks = []
            if not tasks:
                return 0, 0.0, "merge of the shards"
            secs, note = self.eval_seconds(w["model"], tasks), f"{len(tasks)} tasks"
            if rule == "evaluate_seeds":
                secs, note = n_seeds * secs, f"{note}, {n_seeds} seeds"
            return 1, secs, note
        return 0, 0.0, CPU_RULES_NOTE

    def eval_seconds(self, model: str, tasks: list[str]) -> float:
        tokens = 0.0
        for t in tasks:
            items, fwd, gen = EVAL_TASKS.get(t, EVAL_DEFAULT)
            tokens += items * (fwd + DECODE_PENALTY * gen)
        return self.flop_seconds(model, tokens, "forward")


def runtime_estimator(cfg: dict) -> Estimator:
    """The estimator behind the workflow's runtimes (clusterft.plan.resources; the rule files
    hand it to clusterft.plan.inputs.Inputs) for the settled config ``cfg``: the datasets
    with a tokens-per-example estimate (the dataset's ``tokens_per_example`` key, else
    TOKENS_PER_EXAMPLE by hub id) and the models with a known parameter count (a hub id of
    KNOWN_PARAMS, a local folder's config.json); the jobs of the others keep their rules'
    fixed runtimes (``Estimator.job_seconds`` raises KeyError for them)."""
    from clusterft.plan.resources import model_params as known_params

    tpe = {}
    for name, d in cfg["datasets"].items():
        v = d.get("tokens_per_example") or TOKENS_PER_EXAMPLE.get(d.get("hf_dataset", ""))
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            tpe[name] = float(v)
    params = {m: p for m, spec in cfg["models"].items() if (p := known_params(spec)) > 0}
    return Estimator(cfg, tpe, params)


def _shard_tasks(tasks: list[str], n: int) -> list[list[str]]:
    try:
        from clusterft.stages.evaluate import shard_tasks
    except ImportError:  # round-robin, at most one job per task
        n = max(1, min(n, len(tasks)))
        return [tasks[i::n] for i in range(n)]
    return shard_tasks(tasks, n)


def estimate_jobs(cfg: dict, jobs: list[dict], est: Estimator) -> list[dict]:
    """One row per job: rule, its wildcards as text, GPUs, hours and GPU-hours."""
    run_keys = ("dataset", "model", "method", "budget", "gpus", "dist", "seed")
    evaluated = {tuple(j["wildcards"].get(k) for k in run_keys)
                 for j in jobs if j["rule"].startswith("evaluate")}
    score_sharded = {(j["wildcards"]["dataset"], j["wildcards"]["model"], j["wildcards"]["seed"])
                     for j in jobs if j["rule"] == "score_shard"}
    eval_sharded = {tuple(sorted((k, v) for k, v in j["wildcards"].items()
                                 if k not in ("shard", "nshards")))
                    for j in jobs if "shard" in j["wildcards"] and "nshards" in j["wildcards"]}
    rows = []
    for j in jobs:
        rule, w = j["rule"], j["wildcards"]
        if rule == "train":
            merged = tuple(w.get(k) for k in run_keys) not in evaluated  # time-only run
        elif rule == "score":
            merged = (w["dataset"], w["model"], w["seed"]) in score_sharded
        else:
            merged = tuple(sorted(w.items())) in eval_sharded
        gpus, secs, note = est.job_seconds(rule, w, merged)
        disk = est.disk_bytes(rule, w)
        if rule == "train" and tuple(w.get(k) for k in run_keys) not in evaluated:
            disk = 0.0  # only timed: keeps no model (train.keep_model false, NOT_KEPT.json)
        rows.append({"rule": rule, "job": ", ".join(f"{k}={v}" for k, v in w.items()),
                     "gpus": gpus, "hours": secs / 3600, "gpu_hours": secs * gpus / 3600,
                     "disk_gb": disk / 1e9, "note": note})
    return rows


def per_rule(rows: list[dict]) -> list[dict]:
    """Jobs, GPU jobs and GPU-hours per rule (rules in first-seen order), then the total."""
    table: dict[str, dict] = {}
    for r in rows:
        t = table.setdefault(r["rule"], {"rule": r["rule"], "jobs": 0, "gpu_jobs": 0,
                                         "gpu_hours": 0.0, "disk_gb": 0.0})
        t["jobs"] += 1
        t["gpu_jobs"] += int(r["gpus"] > 0)
        t["gpu_hours"] += r["gpu_hours"]
        t["disk_gb"] += r["disk_gb"]
    out = sorted(table.values(), key=lambda t: -t["gpu_hours"])
    out.append({"rule": "total", "jobs": sum(t["jobs"] for t in out),
                "gpu_jobs": sum(t["gpu_jobs"] for t in out),
                "gpu_hours": sum(t["gpu_hours"] for t in out),
                "disk_gb": sum(t["disk_gb"] for t in out)})
    return out


# ----------------------------------------------------------------------------- output
def _csv(rows: list[dict], fields: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k]) for k in fields})
    return buf.getvalue()


def markdown(table: list[dict], est: Estimator, config: str) -> str:
    lines = [f"# GPU-hours and disk of `{config}` (estimated before submitting)", "",
             "| rule | jobs | GPU jobs | GPU-hours | disk (GB) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for t in table:
        bold = "**" if t["rule"] == "total" else ""
        lines.append(f"| {bold}{t['rule']}{bold} | {t['jobs']} | {t['gpu_jobs']} | "
                     f"{bold}{t['gpu_hours']:.1f}{bold} | {bold}{t['disk_gb']:.1f}{bold} |")
    lines += ["", "Assumptions (`clusterft.tools.cost`, `clusterft.analysis.costmodel`; estimates, not "
              "measurements):", "",
              f"- per-GPU throughput: {est.peak:.3g} FLOP/s peak at MFU {est.mfu}; training "
              f"6N (full) or 4N (LoRA) FLOPs per token, forward passes 2N; fixed "
              f"{est.overhead:g} s per optimiser step",
              "- parameters: " + ", ".join(f"{m} {p / 1e9:.3g}B" for m, p in est.params.items()),
              "- tokens per example (mean; lengths log-normal, sigma "
              f"{est.sigma}): " + ", ".join(f"{d} {v:g}" for d, v in est.tpe.items()),
              "- train: the sampler's token plan of a stand-in pool per run (slowest rank's "
              "padded tokens per step); evaluation: per-task item and token estimates "
              f"(generated tokens x{DECODE_PENALTY:g})",
              f"- score: the projection ({est.score['projection']}, dim {est.score['dim']}) "
              "of every example's LoRA gradient at every warm-up checkpoint is counted "
              f"(`costmodel.projection_work`; dense: the D x dim product, and the matrix's "
              f"draws for every batch at {DRAWS_PER_SECOND:.2g} per second), for models whose architecture is known: "
              + (", ".join(m for m, c in est.configs.items() if c is not None) or "none"),
              "- disk: models, LoRA adapters (float32) and feature matrices (float32) the jobs "
              "leave in results/ (train runs that are only timed keep no model); tables, "
              "selections and logs not counted", ""]
    return "\n".join(lines)


def run_cost(config: str | os.PathLike, out: str | os.PathLike = "results/tables/cost",
             tpe_overrides: dict[str, float] | None = None,
             param_overrides: dict[str, float] | None = None, **model_kw: Any) -> list[dict]:
    """Write ``<out>.csv``, ``<out>.md`` and ``<out>_jobs.csv``; return the per-rule table."""
    from clusterft.plan.config import load_config
    from clusterft.pipeline.io import write_text

    cfg = load_config(config)
    source = str(config)
    tpe = tokens_per_example(cfg, tpe_overrides or {}, source)
    params = model_params(cfg, param_overrides or {}, source)
    est = Estimator(cfg, tpe, params, **model_kw)
    jobs = plan_jobs(cfg)
    rows = estimate_jobs(cfg, jobs, est)
    table = per_rule(rows)
    out = str(out)
    write_text(out + "_jobs.csv", _csv(rows, ["rule", "job", "gpus", "hours", "gpu_hours",
                                              "disk_gb", "note"]))
    write_text(out + ".csv", _csv(table, ["rule", "jobs", "gpu_jobs", "gpu_hours", "disk_gb"]))
    write_text(out + ".md", markdown(table, est, source))
    return table


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The cost table's flags, on its own parser and on `clusterft cost` alike."""
    ap.add_argument("--config", required=True,
                    help="a complete workflow config (what snakemake gets as --configfile), "
                         "not one stage's section")
    ap.add_argument("--out", default="results/tables/cost",
                    help="path prefix: writes PREFIX.csv, PREFIX.md and PREFIX_jobs.csv "
                         "(default: %(default)s)")
    ap.add_argument("--tokens-per-example", nargs="*", metavar="DATASET=N",
                    help="mean tokens per example of a dataset (overrides the estimates; "
                         "needed for a hub dataset without one)")
    ap.add_argument("--params", nargs="*", metavar="MODEL=N",
                    help="a model's parameter count (for a hub model not in "
                         "costmodel.KNOWN_PARAMS)")
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_FLOPS,
                    help="dense bf16 peak FLOP/s per GPU (default: %(default)g, H100 SXM)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                    help="assumed model FLOPs utilisation, 0 < MFU <= 1 (default: %(default)s)")
    ap.add_argument("--step-overhead", type=float, default=DEFAULT_STEP_OVERHEAD_S,
                    help="fixed seconds per optimiser step (default: %(default)s)")
    return ap


def build_parser(prog: str = "python -m clusterft.tools.cost") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog=prog, description="GPU-hours per rule and in total of a config's jobs",
        allow_abbrev=False))


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv))


def run_args(a: argparse.Namespace) -> int:
    """Write the cost table of parsed `add_arguments` flags; the exit status (2: bad input)."""
    try:
        if not 0 < a.mfu <= 1 or a.peak_flops <= 0 or a.step_overhead < 0:
            raise InputError("need 0 < --mfu <= 1, --peak-flops > 0, --step-overhead >= 0")
        table = run_cost(a.config, a.out, _pairs(a.tokens_per_example, "tokens-per-example"),
                         _pairs(a.params, "params"), peak_flops=a.peak_flops, mfu=a.mfu,
                         step_overhead_s=a.step_overhead)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in table:
        print(f"{t['rule']:<24} {t['jobs']:>5} jobs {t['gpu_jobs']:>5} on GPUs "
              f"{t['gpu_hours']:>10.1f} GPU-h {t['disk_gb']:>9.1f} GB")
    print(f"wrote {a.out}.csv, {a.out}.md and {a.out}_jobs.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
