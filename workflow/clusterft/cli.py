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


def _prepare_data(a: argparse.Namespace) -> Any:
    from clusterft.stages.data.prepare import run_prepare_data

    cfg = {"source": a.source or a.dataset, **_section(a.config)}
    if a.n:
        cfg["n"] = a.n
    return run_prepare_data(a.dataset, cfg, a.out_pool, a.out_labels, a.out_items,
                            seed=a.seed, out_summary=a.out_summary)


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


def _train(a: argparse.Namespace) -> Any:
    from clusterft.stages.train import main

    return main(a.rest)


def _evaluate(a: argparse.Namespace) -> Any:
    from clusterft.stages.evaluate import run_evaluate

    out = Path(a.out)
    return run_evaluate(a.model, a.tasks, a.items, _section(a.config), out,
                        a.tasks_dir or str(out.with_name(out.stem + "_tasks")), seed=a.seed,
                        out_items=a.out_items)


def _report(a: argparse.Namespace) -> Any:
    from clusterft.tasks.registry import TASKS
    from clusterft.stages.report import run_report

    return run_report(a.runs, a.tables, a.plots, task_specs=TASKS, cfg=_section(a.config))


def targets_args(s: argparse.ArgumentParser, what: str) -> None:
    """The validation examples of the benchmark tasks, as targets of a selection."""
    s.add_argument("--tasks", nargs="+", help=f"tasks whose <task>.val.jsonl are targets ({what})")
    s.add_argument("--items", nargs="+", default=["results/tasks"],
                   help="folders holding the <task>.val.jsonl files")
    s.add_argument("--out-targets", help="the targets' features (.npy)")
    s.add_argument("--out-target-ids", help="their ids and tasks (.parquet)")


def score_pool_args(s) -> None:
    """The model/pool arguments score and score-warmup share."""
    s.add_argument("--model", required=True)
    s.add_argument("--pool", required=True)
    s.add_argument("--dim", type=int)
    s.add_argument("--train-max-length", type=int,
                   help="check the pool against train's max_length first (with --truncation)")
    s.add_argument("--truncation", choices=POLICIES,
                   help="train's policy for over-long examples; 'error'/'reject' fail here early")

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clusterft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)

    def stage(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        if name != "train":
            s.add_argument("--config", help="YAML/JSON file with this stage's config section")
            s.add_argument("--seed", type=int, default=0)
        return s

    s = stage("prepare-data", _prepare_data, "build a pool (skills|pycode|icd10|jsonl) and its benchmark items")
    s.add_argument("--dataset", required=True, help="dataset name (also the source unless --source)")
    s.add_argument("--source", help="skills|pycode|icd10|jsonl|hub (default: the dataset name)")
    s.add_argument("--n", type=int, help="pool size")
    s.add_argument("--out-pool", required=True)
    s.add_argument("--out-labels", required=True)
    s.add_argument("--out-items", required=True, help="folder for <task>.jsonl item files")
    s.add_argument("--out-summary")

    s = stage("corpus", _corpus, "the general corpus for tokenizer/base-model pretraining")
    s.add_argument("--out", required=True)
    s.add_argument("--exclude", nargs="*", default=[], help="pools / benchmark folders to stay disjoint from")

    s = stage("tokenizer", _tokenizer, "train a byte-level BPE tokenizer on a corpus")
    s.add_argument("--corpus", required=True)
    s.add_argument("--vocab-size", type=int)
    s.add_argument("--out", required=True)
    s.add_argument("--allow-downloads", action="store_true")

    s = stage("base-model", _base_model, "build and pretrain a small Llama (or resolve hub/path)")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--corpus", required=True)
    s.add_argument("--size", default="small", help="small|large (sizes in clusterft.stages.models.DEFAULTS)")
    s.add_argument("--out", required=True)
    s.add_argument("--allow-downloads", action="store_true")

    s = stage("score", _score, "per-example LoRA-gradient features and scores")
    score_pool_args(s)
    s.add_argument("--out-features", required=True)
    s.add_argument("--out-scores", required=True)
    s.add_argument("--out-trajectories", help="each example's warm-up loss trajectory (S2L)")
    targets_args(s, "LESS")

    shard_help = ("score in several jobs (one GPU each): score-warmup once, score-shard "
                  "--shard i for i in 0..N-1 (N = the config's shards or --n-shards), then "
                  "score-merge: the same files as score")
    s = stage("score-warmup", _score_warmup, "score's warm-up, shared by the shards; "
              + shard_help)
    score_pool_args(s)
    s.add_argument("--out", required=True, help="the warm-up (.safetensors)")

    s = stage("score-shard", _score_shard, "one shard of score's gradient pass (shard 0 "
              "also the targets); " + shard_help)
    s.add_argument("--model", required=True)
    s.add_argument("--pool", required=True)
    s.add_argument("--warmup", required=True, help="score-warmup's output")
    s.add_argument("--dim", type=int)
    s.add_argument("--shard", type=int, required=True, help="0 .. shards-1")
    s.add_argument("--n-shards", dest="shards", type=int, help="shard count (else the config's)")
    s.add_argument("--out", required=True, help="the shard (.npz)")
    s.add_argument("--tasks", nargs="+", help="tasks whose <task>.val.jsonl are targets "
                   "(LESS; shard 0 computes them)")
    s.add_argument("--items", nargs="+", default=["results/tasks"],
                   help="folders holding the <task>.val.jsonl files")

    s = stage("score-merge", _score_merge, "merge score's shards into score's outputs; "
              + shard_help)
    s.add_argument("--model", required=True)
    s.add_argument("--pool", required=True)
    s.add_argument("--warmup", required=True, help="score-warmup's output")
    s.add_argument("--dim", type=int)
    s.add_argument("--shards", nargs="+", required=True, help="the shard files, in order")
    s.add_argument("--out-features", required=True)
    s.add_argument("--out-scores", required=True)
    s.add_argument("--out-trajectories", help="each example's warm-up loss trajectory (S2L)")
    targets_args(s, "LESS; as given to score-shard")

    s = stage("features", _features, "embedding or tfidf features in score's format")
    s.add_argument("--kind", required=True, choices=("embedding", "tfidf"))
    s.add_argument("--pool", required=True)
    s.add_argument("--model", help="base model folder (embedding)")
    s.add_argument("--out-features", required=True)
    s.add_argument("--out-scores", required=True)
    targets_args(s, "RDS+; embedding only")

    s = stage("loss-features", _loss_features, "loss-trajectory features (S2L) of a score run")
    s.add_argument("--trajectories", required=True)
    s.add_argument("--scores", required=True, help="the same score run's scores.parquet (ids)")
    s.add_argument("--out-features", required=True)
    s.add_argument("--out-scores", required=True)

    s = stage("cluster", _cluster, "cosine k-means of the features")
    s.add_argument("--features", required=True)
    s.add_argument("--scores", required=True)
    s.add_argument("--k", type=int)
    s.add_argument("--out-clusters", required=True)
    s.add_argument("--out-centroids", required=True)

    s = stage("select", _select, "budgeted selection: " + " | ".join(METHODS))
    s.add_argument("--clusters", required=True)
    s.add_argument("--scores", required=True)
    s.add_argument("--method", required=True, choices=METHODS)
    s.add_argument("--budget", type=float, default=1.0)
    s.add_argument("--labels", help="labels.parquet (oracle)")
    s.add_argument("--epochs", type=int, default=1, help="per-epoch subsets (rs2)")
    s.add_argument("--features", help="the pool's features.npy (less, rds)")
    s.add_argument("--targets", help="the validation examples' targets.npy (less, rds)")
    s.add_argument("--target-ids", help="their targets.parquet (less, rds)")
    s.add_argument("--out-selection", required=True)
    s.add_argument("--out-summary", required=True)

    s = stage("train", _train, "fine-tune (one process; use torchrun -m clusterft.stages.train for DDP); "
              "arguments as `python -m clusterft.stages.train --help`")
    s.add_argument("rest", nargs=argparse.REMAINDER)

    s = stage("cost", lambda a: None, "GPU-hours per rule and in total of a whole config's jobs "
              "(--config: a complete workflow config); as `python -m clusterft.tools.cost --help`")
    s.add_argument("rest", nargs=argparse.REMAINDER)

    s = stage("evaluate", _evaluate, "lm-eval on repo-defined (or built-in) tasks")
    s.add_argument("--model", required=True)
    s.add_argument("--tasks", nargs="+", required=True)
    s.add_argument("--items", nargs="+", default=["results/tasks"],
                   help="folders holding <task>.jsonl item files")
    s.add_argument("--out", required=True)
    s.add_argument("--tasks-dir", help="where the generated task YAMLs go")
    s.add_argument("--out-items", help="per-item results (parquet) for paired comparisons")

    s = stage("report", _report, "tables, plots and findings from a run table (CSV/JSON)")
    s.add_argument("--runs", required=True)
    s.add_argument("--tables", default="results/tables")
    s.add_argument("--plots", default="results/plots")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"] and not {"-h", "--help"} & set(argv[1:2]):
        # train's own parser takes every argument (argparse's REMAINDER does not start at
        # an option such as --model)
        from clusterft.stages.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["cost"]:
        from clusterft.tools.cost import main as cost_main  # its --config is a whole config, not a section

        return cost_main(argv[1:])
    args = build_parser().parse_args(argv)
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
