"""The method's free choices decided by skill recovery on a development cell (issue 30, item 4).

Which warm-up, which LoRA modules, which loss normalisation, centring or not, which k: each
is decided here by how well the gradient clusters recover the pool's TRUE skills (ARI of
``cluster`` against the labels, ``clusterft.analysis.stats.cluster_agreement``) on a
development pool and seed that no reported run uses (data seed 1000; reported runs use 0),
then held fixed (docs/method_choices.md). One choice is varied at a time from the base
(the embedded default's ``score:`` and ``cluster:`` sections, config/config.yaml), then
the winners are combined once.

Per pool: the pool is built (``clusterft.pools.<pool>.build(shape, seed)``) into a temp
folder (``write_jsonl``), and every variant runs the score stage (``run_score``: warm-up,
per-example gradients, projection) and the cluster stage (``run_cluster``) through their
entry points with the variant's overrides; cluster-only variants reuse the base features.

    python benchmarks/method_choices.py [--pools cipher,skills] [--variants base,center,...]
        [--model results/models/small/base] [--seed 1000] [--threads 2]
        [--out benchmarks/out/method_choices] [--design first|second]

``--design first`` (the default) is the study as first run: the first testbed shape
(``POOLS``) and variants over the old base (``VARIANTS``). ``--design second`` repeats it on
the testbed as frozen now: the cipher shape of config/config.yaml's ``datasets.cipher``
(the reported pool size, on the development seed), the base the embedded default as it is
now (``NOW``: its score section over the stage defaults, ``cluster.k`` 16) and one change
at a time from it (``VARIANTS_NOW``); the model should be the practised small base model
the embedded default trains (``results/models/small/base`` of a run of config/config.yaml).

Appends one row per (pool, variant) to ``<out>/method_choices.csv``
(``method_choices_second.csv`` with ``--design second``) (variant, pool, ARI,
NMI, purity, seconds, overrides) and prints it as it goes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))

import numpy as np  # noqa: E402

# The development cells: pool module, frozen shape settings (never a reported cell's seed).
POOLS = {
    "cipher": {"n": 3000, "n_skills": 12, "n_words": 16, "words_per_example": 3,
               "zipf_s": 1.2},
    "skills": {"n": 2000},
}

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]

# The base: the embedded default's score and cluster sections (config/config.yaml) over the
# stage defaults as they were before this study (warmup_lr 1e-3, LoRA on attention only:
# written out, so the table reproduces after the defaults changed), with loss_points at its
# minimum (the loss trajectories do not enter the features or clusters; they cost forward
# passes only).
BASE_SCORE = {"dim": 128, "max_length": 128, "warmup_steps": 20, "loss_points": 2,
              "checkpoint_every": 0, "warmup_lr": 1.0e-3,
              "lora": {"target_modules": ATTENTION}}
BASE_CLUSTER = {"k": 16}
# "defaults": the stage defaults as they are now, with the config.yaml lines
# docs/method_choices.md recommends (warmup_steps 60) and nothing of BASE_SCORE's old values.
NEW_DEFAULTS = {"dim": 128, "max_length": 128, "warmup_steps": 60, "loss_points": 2,
                "checkpoint_every": 0}
COMBINED = {"warmup_steps": 60, "warmup_lr": 3.0e-3, "lora": {"target_modules": MLP}}

# name -> (score overrides, cluster overrides); "K=labels" / "K=2labels": k from the pool.
VARIANTS: dict[str, tuple[dict, dict]] = {
    "base": ({}, {}),
    # 1. warm-up length and learning rate
    "warmup0": ({"warmup_steps": 0}, {}),
    "warmup5": ({"warmup_steps": 5}, {}),
    "warmup60": ({"warmup_steps": 60}, {}),
    "warmup_epochs4": ({"warmup_steps": None}, {}),  # the stage default: 4 epochs of 5%
    "lr3e-4": ({"warmup_lr": 3.0e-4}, {}),
    "lr3e-3": ({"warmup_lr": 3.0e-3}, {}),
    # 2. centring before cosine k-means
    "center": ({}, {"center": True}),
    # 3. LoRA modules
    "lora_mlp": ({"lora": {"target_modules": MLP}}, {}),
    # 4. loss normalisation
    "loss_sum": ({"loss_normalization": "sum"}, {}),
    # 5. k against the number of labels
    "k=labels": ({}, {"k": "labels"}),
    "k=2labels": ({}, {"k": "2labels"}),
    # the winners combined once (and with the runner-up choices)
    "combined": (COMBINED, {}),
    "combined+center": (COMBINED, {"center": True}),
    "combined_epochs4": ({**COMBINED, "warmup_steps": None}, {}),
    "defaults": (None, {}),  # NEW_DEFAULTS: must equal "combined"
}


# --design second: the embedded default's score section as it is now (config/config.yaml
# over the stage defaults: warmup_lr 3e-3, LoRA on attention and MLP, mean loss), loss_points
# at its minimum as above; variants change one thing from it. The first study's
# recommendation is what the embedded default became, so its base is NEW_DEFAULTS
# (before the second study's decision set cluster.center in config/config.yaml).
NOW = dict(NEW_DEFAULTS)
VARIANTS_NOW: dict[str, tuple[dict, dict]] = {
    "now": ({}, {}),
    "warmup0": ({"warmup_steps": 0}, {}),
    "warmup20": ({"warmup_steps": 20}, {}),
    "warmup200": ({"warmup_steps": 200}, {}),
    "lr1e-3": ({"warmup_lr": 1.0e-3}, {}),
    "lr1e-2": ({"warmup_lr": 1.0e-2}, {}),
    "center": ({}, {"center": True}),
    "lora_attn": ({"lora": {"target_modules": ATTENTION}}, {}),
    "loss_sum": ({"loss_normalization": "sum"}, {}),
    "k=labels": ({}, {"k": "labels"}),
    "k=4labels": ({}, {"k": "4labels"}),
}


def config_shape(name: str) -> dict:
    """``datasets.<name>`` of config/config.yaml, less the keys that are not the pool's."""
    import importlib

    import yaml

    mod = importlib.import_module(f"clusterft.pools.{name}")
    ds = yaml.safe_load((ROOT / "config/config.yaml").read_text())["datasets"][name]
    return {k: v for k, v in ds.items() if k in mod.DEFAULTS}


def build_pool(name: str, seed: int, tmp: Path, shape: dict | None = None
               ) -> tuple[Path, np.ndarray]:
    import importlib

    from clusterft.pipeline.io import write_jsonl

    mod = importlib.import_module(f"clusterft.pools.{name}")
    built = mod.build({**mod.DEFAULTS, **(POOLS[name] if shape is None else shape)}, seed=seed)
    path = tmp / f"{name}.jsonl"
    write_jsonl(path, built.records)
    return path, np.asarray(built.labels)


def parse_variant(text: str, named: dict | None = None) -> tuple[dict, dict]:
    """A named variant, or an ad-hoc one: ``score={json}|cluster={json}``."""
    named = VARIANTS if named is None else named
    if text in named:
        return named[text]
    score, cluster = {}, {}
    for part in text.split("|"):
        key, _, value = part.partition("=")
        {"score": score, "cluster": cluster}[key].update(json.loads(value))
    return score, cluster


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_variant(model: str, pool: Path, truth: np.ndarray, score_o: dict, cluster_o: dict,
                work: Path, seed: int, threads: int, cache: dict,
                base: dict | None = None) -> dict:
    from clusterft.analysis.stats import cluster_agreement
    from clusterft.stages.cluster import run_cluster
    from clusterft.stages.score import run_score

    base = BASE_SCORE if base is None else base
    scfg = dict(NEW_DEFAULTS) if score_o is None else deep_merge(base, score_o)
    key = json.dumps(scfg, sort_keys=True)
    t0 = time.perf_counter()
    if key not in cache:
        d = work / f"score{len(cache)}"
        d.mkdir()
        run_score(model, pool, scfg, d / "features.npy", d / "scores.parquet", seed=seed,
                  threads=threads)
        cache[key] = (d, time.perf_counter() - t0)
    d, score_s = cache[key]
    n_labels = len(np.unique(truth))
    ccfg = dict(BASE_CLUSTER, **cluster_o)
    ccfg["k"] = {"labels": n_labels, "2labels": 2 * n_labels,
                 "4labels": 4 * n_labels}.get(ccfg["k"], ccfg["k"])
    t1 = time.perf_counter()
    out = work / f"clusters{time.perf_counter_ns()}"
    summary = run_cluster(d / "features.npy", d / "scores.parquet", ccfg,
                          str(out) + ".parquet", str(out) + ".npy", seed=seed)
    cluster_s = time.perf_counter() - t1
    import pandas as pd

    labels = pd.read_parquet(str(out) + ".parquet")["cluster"].to_numpy()
    agree = cluster_agreement(labels, truth)
    return {"ari": round(agree["ari"], 4), "nmi": round(agree["nmi"], 4),
            "purity": round(agree["purity"], 4), "k": summary["k"], "n_labels": n_labels,
            "score_s": round(score_s, 1), "cluster_s": round(cluster_s, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--design", choices=("first", "second"), default="first",
                    help="first: the study as first run (POOLS, VARIANTS); second: the "
                         "testbed's shape from config/config.yaml and the variants over "
                         "the embedded default as it is now (VARIANTS_NOW)")
    ap.add_argument("--pools", default=None,
                    help="default: cipher,skills (first), cipher (second)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names of VARIANTS, or ';'-separated ad-hoc "
                         "'score={json}|cluster={json}' with --adhoc")
    ap.add_argument("--adhoc", action="store_true",
                    help="--variants is ';'-separated 'name:score={json}|cluster={json}'")
    ap.add_argument("--model", default=str(ROOT / "results/models/small/base"))
    ap.add_argument("--seed", type=int, default=1000,
                    help="data seed of the pool AND seed of score and cluster (default 1000: "
                         "a development seed no reported run uses)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/method_choices"))
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    second = args.design == "second"
    table = VARIANTS_NOW if second else VARIANTS
    base = NOW if second else None
    pools = args.pools or ("cipher" if second else "cipher,skills")
    names = args.variants or ",".join(table)
    if args.adhoc:
        named = [v.split(":", 1) for v in names.split(";")]
        variants = [(n, parse_variant(t, table)) for n, t in named]
    else:
        variants = [(v, parse_variant(v, table)) for v in names.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / ("method_choices_second.csv" if second else "method_choices.csv")
    fields = ["pool", "variant", "seed", "ari", "nmi", "purity", "k", "n_labels", "score_s",
              "cluster_s", "score_overrides", "cluster_overrides"]
    new = not csv_path.exists()
    with tempfile.TemporaryDirectory(prefix="method-choices-") as tmp:
        tmp = Path(tmp)
        with open(csv_path, "a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            if new:
                w.writeheader()
            for pool_name in pools.split(","):
                shape = config_shape(pool_name) if second else None
                pool, truth = build_pool(pool_name, args.seed, tmp, shape)
                cache: dict = {}
                for name, (so, co) in variants:
                    work = tmp / f"{pool_name}-{name}"
                    work.mkdir(exist_ok=True)
                    row = run_variant(args.model, pool, truth, so, co, work, args.seed,
                                      args.threads, cache, base)
                    row = {"pool": pool_name, "variant": name, "seed": args.seed, **row,
                           "score_overrides": json.dumps(so), "cluster_overrides": json.dumps(co)}
                    print(json.dumps(row), flush=True)
                    w.writerow(row)
                    fh.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
