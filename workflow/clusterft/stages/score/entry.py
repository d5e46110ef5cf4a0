"""The score stage's entry points, one path for one job and for N: warm-up, gradient pass
over shards of the length-sorted pool, merge.

- ``run_score`` (rule ``score`` with ``score.shards: 1``) does all three in one process:
  the warm-up kept in memory, the gradient pass over the whole pool as its one shard, and
  the merge (:func:`compute_features_info`, the same on a model already in memory).
- ``run_score_warmup`` (rule ``score_warmup``) trains the warm-up once and writes it
  (``clusterft.stages.score.warmup``: adapters and moments at every checkpoint, adapters at
  every loss step, the pool's token lengths, the fingerprint of config, seed, model, pool).
- ``run_score_shard`` (rule ``score_shard``, one per shard) runs the gradient pass over its
  shard (``clusterft.stages.score.gradient_pass``); shard 0 also the targets.
- ``run_score_merge`` (rule ``score`` with ``score.shards`` > 1) checks that the shards come
  from one warm-up (provenance lineage ``score_warmup``) and cover the pool once, and
  writes the files ``run_score`` writes, with the same bytes.

Every job resumes after a kill from a folder beside its output: ``<features>.ckpt/``,
``<warmup>.ckpt/``, ``<shard>.ckpt/`` (``clusterft.stages.score.resume``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from clusterft.modeling import cpu_matmul
from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError
from clusterft.stages.score.gradient_pass import empty_arrays, gradient_pass, shard_bounds
from clusterft.stages.score.gradients import lora_parameters
from clusterft.stages.score.merge import (TARGET_SHARD, SHARD_FORMAT, assemble, check_cover,
                                          load_shard, pool_features, save_shard,
                                          target_features, write_score)
from clusterft.stages.score.model import load_base, num_threads, scoring_model
from clusterft.stages.score.resume import Checkpoints, score_fingerprint
from clusterft.stages.score.settings import check_shards, merge_cfg
from clusterft.stages.score.warmup import load_warmup, loss_steps, save_warmup, warm_up

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- in memory

def compute_features_info(model, tokenizer, examples: Sequence[dict], cfg: dict | None,
                          seed: int = 0, ckpt: Checkpoints | None = None,
                          targets: Sequence[dict] | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """``compute_features`` plus an info dict (warm-up losses, timings, truncation count,
    ``checkpoint_steps`` and ``checkpoint_weights``, and ``loss_trajectories``: float32
    [N, loss_points] in the order of ``examples``).
    ``ckpt``: where the warm-up and the gradient pass keep resumable progress.
    ``targets``: records (pool format) whose features come from the same warm-up and
    projection after the pool's: ``target_features`` (float32 [M, warmup_checkpoints *
    dim], in the order of ``targets``) and ``targets_truncated`` in the info."""
    cfg = merge_cfg(cfg)
    if len(examples) == 0:
        raise InputError("no examples to score", field="pool")
    if targets is not None and len(targets) == 0:
        raise InputError("no target examples (targets is empty)", field="targets")
    if tokenizer.pad_token_id is None:
        raise InputError("tokenizer has no pad token", field="model")
    cfg, _ = _resolve_lengths(cfg, examples, None, tokenizer)  # auto: these examples'
    with num_threads(cfg):
        return _one_job(model, tokenizer, examples, cfg, seed, ckpt, targets)


def _one_job(model, tokenizer, examples: Sequence[dict], cfg: dict, seed: int,
             ckpt: Checkpoints | None, targets: Sequence[dict] | None) -> tuple:
    """The warm-up, the gradient pass over one shard that holds the whole pool, and the
    merge, in memory (:func:`compute_features_info`)."""
    t0 = time.perf_counter()
    pad_id = tokenizer.pad_token_id
    encoded, n_trunc = _encode_all(tokenizer, examples, cfg)
    enc_targets, t_trunc = (_encode_all(tokenizer, targets, cfg, "targets")
                            if targets is not None else (None, 0))
    order = np.argsort([e["length"] for e in encoded], kind="stable")  # the one shard's rows
    with scoring_model(model, cfg, seed) as scoring:
        w, info = warm_up(scoring, encoded, cfg, seed, pad_id, ckpt, None)
        t_warm = time.perf_counter() - t0
        arrays, resumed = gradient_pass(scoring, cfg, w, [encoded[i] for i in order], order,
                                        examples, pad_id, enc_targets, ckpt)
        lora_dim = sum(p.numel() for _, p in lora_parameters(scoring.model))
        proj = scoring.proj
    checkpoints = w["checkpoints"]
    projected, norms, trajectories = assemble([{**arrays, "rows": order}], len(examples),
                                              len(checkpoints), int(cfg["dim"]))
    features, scores, weights = pool_features(projected, norms, checkpoints, examples, cfg)
    if enc_targets is not None:
        info["target_features"] = target_features(arrays["target_projected"],
                                                  arrays["target_norms"], weights, targets, cfg)
        info["targets_truncated"] = t_trunc
    for key in ("exp_avg", "exp_avg_sq", "checkpoints", "loss_snapshots"):
        info.pop(key, None)
    info.update({"loss_trajectories": trajectories, "gradients_resumed_at": resumed,
                 "n": len(encoded), "truncated": n_trunc, "lora_dim": lora_dim,
                 "dim": int(features.shape[1]), "projection_dim": int(cfg["dim"]),
                 "projection": cfg["projection"],
                 **({"projection_blocks": proj.blocks(), "projection_pad": proj.pad}
                    if cfg["projection"] == "kronecker" else {}),
                 "checkpoint_steps": [int(c["step"]) for c in checkpoints],
                 "checkpoint_weights": weights, "method": cfg["method"],
                 "device": scoring.device, "precision": scoring.precision,
                 "warmup_seconds": round(t_warm, 2),
                 "seconds": round(time.perf_counter() - t0, 2)})
    return features, scores, norms[-1], info


def compute_features(model, tokenizer, examples: Sequence[dict], cfg: dict | None,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient features of pool examples: (features [N, warmup_checkpoints * dim] float32
    L2-normalised rows, scores [N], grad_norms [N]), all in the order of ``examples``.

    ``model`` is a base causal LM (HF ``LlamaForCausalLM`` or similar); LoRA adapters are
    added, warmed up and removed again, so the model is unchanged on return (weights,
    modules, requires_grad flags, attention kernel; it is moved to ``device`` though).
    ``examples`` are pool records (``messages`` lists). Deterministic in ``seed`` (adapter
    init, warm-up subset and order, projection).
    """
    features, scores, norms, _ = compute_features_info(model, tokenizer, examples, cfg, seed)
    return features, scores, norms


# --------------------------------------------------------------------------- shared by the jobs

def _prepare(model_dir, pool, cfg: dict | None, threads: int | None):
    """Merged cfg, pool records, resolved model path (offline; Snakemake's ``threads`` set
    unless cfg sets num_threads); ``score.shards`` checked against the pool."""
    import torch

    from clusterft.modeling.hf import resolve_model
    from clusterft.pipeline.io import set_offline_env
    from clusterft.pools.poolfile import load_pool

    set_offline_env()
    cpu_matmul.from_env()
    cfg = merge_cfg(cfg)
    if threads and not cfg["num_threads"]:
        torch.set_num_threads(int(threads))
    records = load_pool(pool)
    check_shards(cfg["shards"], len(records), path=str(pool))
    return cfg, records, resolve_model(str(model_dir), field="score model")


def _fingerprint(cfg: dict, seed: int, model_path: str, pool: Any) -> str:
    return score_fingerprint(cfg, seed, provenance.digest(model_path), provenance.digest(pool))


def _encode_all(tokenizer, examples: Sequence[dict], cfg: dict, what: str = "examples"
                ) -> tuple[list[dict], int]:
    from clusterft.modeling.tokenize import encode_truncated

    return encode_truncated(tokenizer, examples, int(cfg["max_length"]), what)


def _resolve_lengths(cfg: dict, records: Sequence[dict], path: str | None, tok=None
                     ) -> tuple[dict, dict]:
    """score.max_length auto measured on the pool (clusterft.modeling.lengths): (cfg with an
    integer max_length, what the job records: {} for a fixed value). Before any fingerprint:
    runs and their checkpoints are told apart by the resolved value."""
    from clusterft.modeling.lengths import is_auto, resolve_lengths

    if not is_auto(cfg["max_length"]):
        return cfg, {}
    if tok is None:
        from clusterft.modeling.hf import load_tokenizer

        tok = load_tokenizer(path)
    return resolve_lengths(cfg, "score", tok, records, path)


def _check_length_policy(tok, records: Sequence[dict], length_policy: dict | None,
                         pool: Any) -> None:
    """Train's length policy over the whole pool, before the model loads, so an over-long
    example under 'error' (or a pool that 'reject' would empty) stops the run here rather
    than at train."""
    from clusterft.modeling.lengths import resolve_lengths
    from clusterft.modeling.tokenize import LENGTH_POLICY, check_length_policy

    if length_policy is None:
        return
    # train's max_length auto: the value train will resolve on this pool
    policy, _ = resolve_lengths({**LENGTH_POLICY, **length_policy}, "train", tok, records)
    counts = check_length_policy(tok, records, int(policy["max_length"]),
                                 str(policy["truncation"]), str(pool))
    log.info("train length check: %d of %d examples longer than max_length = %s (%s)",
             counts["too_long"], counts["n"], policy["max_length"], policy["truncation"])


def _checked_warmup(warmup: Any, cfg: dict, seed: int, path: str, pool: Any) -> dict:
    """The warm-up file, refused unless it was made with this config, seed, model, pool."""
    w = load_warmup(warmup)
    if w["fingerprint"] != _fingerprint(cfg, seed, path, pool):
        raise InputError("this warm-up was made with another score config, seed, model or "
                         f"pool than {pool} with seed {seed}; rerun score_warmup "
                         f"({provenance.describe(warmup, provenance.read(warmup))})",
                         path=str(warmup), field="score")
    return w


def _outs(out_features, out_scores, out_trajectories, out_targets, out_target_ids) -> dict:
    return {"features": out_features, "scores": out_scores, "trajectories": out_trajectories,
            "targets": out_targets, "target_ids": out_target_ids}


# --------------------------------------------------------------------------- one job

def run_score(model_dir: str | os.PathLike, pool: str | os.PathLike, cfg: dict | None,
              out_features: str | os.PathLike, out_scores: str | os.PathLike, seed: int = 0,
              threads: int | None = None, length_policy: dict | None = None,
              out_trajectories: str | os.PathLike | None = None, targets: Any = None,
              out_targets: str | os.PathLike | None = None,
              out_target_ids: str | os.PathLike | None = None) -> dict:
    """Stage `score` in one job: write features.npy [N, warmup_checkpoints * dim] and
    scores.parquet (id, score, grad_norm), and with ``out_trajectories`` the loss
    trajectories (float32 [N, loss_points] .npy, pool order; output role "trajectories" in
    the provenance).

    ``targets`` (for LESS): the benchmark tasks' validation examples, as ``(items_dir,
    tasks)`` / ``{"items_dir": ..., "tasks": [...]}`` (their ``<task>.val.jsonl``; the
    items folder is checked as an input, so items of another prepare_data run than the
    pool's are refused) or ``(records, task_of_record)`` from
    ``clusterft.tasks.targets.val_records``. Needs ``out_targets`` (float32 [M,
    warmup_checkpoints * dim] .npy, the target features; role "targets") and
    ``out_target_ids`` (parquet: id, task, row order; role "target_ids"). The pool's
    outputs are the same bytes with or without targets.

    ``threads`` (e.g. Snakemake's) sets torch's thread count unless cfg sets num_threads.
    ``length_policy`` ({max_length, truncation}, train's) is checked over the whole pool
    before the model loads. Returns the info dict (warm-up losses, timings, truncation
    count) without the trajectory array (``compute_features_info`` returns it).
    """
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.tasks.targets import check_outputs, resolve_targets

    cfg, records, path = _prepare(model_dir, pool, cfg, threads)
    check_outputs(targets, out_targets, out_target_ids)
    t_records, t_tasks, t_dirs = resolve_targets(targets) if targets is not None else (None, [], [])
    checked = provenance.check_inputs({"model": path, "pool": pool, "items": t_dirs or None},
                                      "score")
    tok = load_tokenizer(path)
    cfg, lengths = _resolve_lengths(cfg, records, path, tok)
    _check_length_policy(tok, records, length_policy, pool)
    model = load_base(path, cfg)
    ckpt_dir = Path(str(out_features) + ".ckpt")
    ckpt = (Checkpoints(ckpt_dir, _fingerprint(cfg, seed, path, pool))
            if int(cfg["checkpoint_every"]) > 0 else None)
    features, scores, norms, info = compute_features_info(model, tok, records, cfg, seed, ckpt,
                                                          t_records)
    write_score(_outs(out_features, out_scores, out_trajectories, out_targets, out_target_ids),
                records, features, scores, norms, info.pop("loss_trajectories"),
                (info.pop("target_features", None), t_records, t_tasks), checked,
                {**cfg, **lengths}, seed)
    info.update(lengths)
    if out_targets is not None:
        info["n_targets"] = len(t_records or [])
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # the features are complete
    log.info("scored %d examples in %.1fs (warm-up %.1fs, %d truncated)", info["n"],
             info["seconds"], info["warmup_seconds"], info["truncated"])
    return info


# --------------------------------------------------------------------------- N jobs

def run_score_warmup(model_dir: str | os.PathLike, pool: str | os.PathLike, cfg: dict | None,
                     out_warmup: str | os.PathLike, seed: int = 0, threads: int | None = None,
                     length_policy: dict | None = None) -> dict:
    """Rule ``score_warmup``: train the warm-up once and write ``out_warmup`` and its
    provenance sidecar (lineage ``score_warmup``: the shards and the merge check they use
    this one). Resumes from ``<out_warmup>.ckpt/``."""
    from clusterft.modeling.hf import load_tokenizer

    t0 = time.perf_counter()
    cfg, records, path = _prepare(model_dir, pool, cfg, threads)
    checked = provenance.check_inputs({"model": path, "pool": pool}, "score_warmup")
    tok = load_tokenizer(path)
    cfg, lengths = _resolve_lengths(cfg, records, path, tok)
    _check_length_policy(tok, records, length_policy, pool)
    if tok.pad_token_id is None:
        raise InputError("tokenizer has no pad token", field="model")
    encoded, n_trunc = _encode_all(tok, records, cfg)
    fp = _fingerprint(cfg, seed, path, pool)
    ckpt_dir = Path(str(out_warmup) + ".ckpt")
    ckpt = Checkpoints(ckpt_dir, fp) if int(cfg["checkpoint_every"]) > 0 else None
    with num_threads(cfg), scoring_model(load_base(path, cfg), cfg, seed) as scoring:
        w, info = warm_up(scoring, encoded, cfg, seed, tok.pad_token_id, ckpt, fp)
    save_warmup(out_warmup, w, cfg["gradient_type"] == "adam")
    recorded = {**{k: v for k, v in cfg.items() if k != "shards"}, **lengths}  # every count's
    provenance.write({"warmup": out_warmup}, "score_warmup", checked,
                     inherit=("pool", "model"), own={"score_warmup": "warmup"},
                     config=recorded, seed=seed)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    out = {"n": len(records), "truncated": n_trunc,
           "checkpoint_steps": [int(c["step"]) for c in info["checkpoints"]],
           "warmup_steps": info["warmup_steps"], "warmup_resumed": info["warmup_resumed"],
           **lengths,
           "seconds": round(time.perf_counter() - t0, 2)}
    log.info("score warm-up: %d steps on %d examples in %.1fs", info["warmup_steps"],
             info["warmup_examples"], out["seconds"])
    return out


def run_score_shard(model_dir: str | os.PathLike, pool: str | os.PathLike,
                    warmup: str | os.PathLike, cfg: dict | None, shard: int,
                    out_shard: str | os.PathLike, seed: int = 0, threads: int | None = None,
                    targets: Any = None) -> dict:
    """Rule ``score_shard``: shard ``shard`` of ``score.shards`` of the gradient pass into
    ``out_shard`` (.npz: the pool rows it holds, their raw projected gradients per
    checkpoint, gradient norms and loss trajectories) and its sidecar. ``targets`` as for
    ``run_score`` (used by shard 0 only). Resumes from ``<out_shard>.ckpt/``."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.tasks.targets import resolve_targets

    t0 = time.perf_counter()
    cfg, records, path = _prepare(model_dir, pool, cfg, threads)
    shards = int(cfg["shards"])
    if not 0 <= int(shard) < shards:
        raise InputError(f"shard {shard} is not one of 0..{shards - 1} (score.shards = "
                         f"{shards})", field="score.shards")
    with_targets = targets is not None and int(shard) == TARGET_SHARD
    t_records, t_tasks, t_dirs = (resolve_targets(targets) if with_targets
                                  else (None, [], []))
    checked = provenance.check_inputs({"model": path, "pool": pool, "warmup": warmup,
                                       "items": t_dirs or None}, "score_shard")
    cfg, lengths = _resolve_lengths(cfg, records, path)
    w = _checked_warmup(warmup, cfg, seed, path, pool)
    lo, hi = shard_bounds(w["lengths"], int(cfg["batch_size"]), shards)[int(shard)]
    rows = np.argsort(w["lengths"], kind="stable")[lo:hi]
    tok = load_tokenizer(path)
    encoded, _ = _encode_all(tok, [records[i] for i in rows], cfg)
    if [e["length"] for e in encoded] != w["lengths"][rows].tolist():
        raise InputError("the pool's token lengths differ from the warm-up's: another "
                         "tokenizer or max_length", path=str(warmup), field="score.max_length")
    enc_targets = _encode_all(tok, t_records, cfg, "targets")[0] if with_targets else None
    fp = hashlib.sha1(json.dumps({"warmup": provenance.digest(warmup), "shard": int(shard),
                                  "shards": shards, "cfg": w["fingerprint"]}
                                 ).encode()).hexdigest()
    ckpt_dir = Path(str(out_shard) + ".ckpt")
    ckpt = Checkpoints(ckpt_dir, fp) if int(cfg["checkpoint_every"]) > 0 else None
    with num_threads(cfg):
        blob, resumed = _shard_arrays(path, cfg, seed, w, encoded, rows, records, enc_targets,
                                      ckpt, tok.pad_token_id, f"score shard {shard}")
    blob.update({"format": np.array(SHARD_FORMAT), "shard": np.array(int(shard)),
                 "shards": np.array(shards), "bounds": np.array([lo, hi]),
                 "rows": rows.astype(np.int64)})
    if with_targets:
        blob.update({"target_ids": np.array([str(r["id"]) for r in t_records], dtype=str),
                     "target_tasks": np.array([str(t) for t in t_tasks], dtype=str)})
    save_shard(out_shard, blob)
    provenance.write({"shard": out_shard}, "score_shard", checked,
                     inherit=("warmup", "items"), config={**cfg, **lengths}, seed=seed)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    secs = round(time.perf_counter() - t0, 2)
    log.info("score shard %d of %d: rows %d..%d of the length-sorted pool (%d examples%s) "
             "in %.1fs", shard, shards, lo, hi, len(rows),
             f", {len(t_records)} targets" if with_targets else "", secs)
    return {"shard": int(shard), "shards": shards, "rows": [int(lo), int(hi)], "n": len(rows),
            "n_targets": len(t_records) if with_targets else 0,
            "gradients_resumed_at": resumed, "seconds": secs}


def _shard_arrays(path: str, cfg: dict, seed: int, w: dict, encoded: Sequence[dict],
                  rows: np.ndarray, records: Sequence[dict],
                  enc_targets: Sequence[dict] | None, ckpt: Checkpoints | None, pad_id: int,
                  what: str) -> tuple[dict, dict | None]:
    """:func:`gradient_pass` of one shard on the model at ``path`` (not loaded for an empty
    shard without targets)."""
    if not len(rows) and enc_targets is None:
        at = loss_steps(int(w["info"]["warmup_steps"]), int(cfg["loss_points"]))
        return empty_arrays(len(w["checkpoints"]), 0, int(cfg["dim"]), len(at)), None
    with scoring_model(load_base(path, cfg), cfg, seed) as scoring:
        return gradient_pass(scoring, cfg, w, encoded, rows, records, pad_id, enc_targets,
                             ckpt, what)


def run_score_merge(model_dir: str | os.PathLike, pool: str | os.PathLike,
                    warmup: str | os.PathLike, shard_paths: Sequence[str | os.PathLike],
                    cfg: dict | None, out_features: str | os.PathLike,
                    out_scores: str | os.PathLike, seed: int = 0,
                    out_trajectories: str | os.PathLike | None = None, targets: Any = None,
                    out_targets: str | os.PathLike | None = None,
                    out_target_ids: str | os.PathLike | None = None) -> dict:
    """Rule ``score`` with ``score.shards`` > 1: the shards into ``run_score``'s files, with
    the same bytes. Refuses shards of another warm-up (provenance), of another shard count,
    or that do not cover the pool exactly once."""
    from clusterft.tasks.targets import check_outputs, resolve_targets

    cfg, records, path = _prepare(model_dir, pool, cfg, None)
    check_outputs(targets, out_targets, out_target_ids)
    _, _, t_dirs = resolve_targets(targets) if targets is not None else (None, [], [])
    shards = int(cfg["shards"])
    if len(shard_paths) != shards:
        raise InputError(f"{len(shard_paths)} shard files for score.shards = {shards}",
                         field="score.shards")
    checked = provenance.check_inputs({"model": path, "pool": pool, "items": t_dirs or None,
                                       "warmup": warmup, "shards": list(shard_paths)},
                                      "score")
    cfg, lengths = _resolve_lengths(cfg, records, path)
    w = _checked_warmup(warmup, cfg, seed, path, pool)
    blobs = [load_shard(p) for p in shard_paths]
    check_cover(blobs, shard_paths, shard_bounds(w["lengths"], int(cfg["batch_size"]), shards),
                np.argsort(w["lengths"], kind="stable"))
    checkpoints = w["info"]["checkpoints"]
    projected, norms, trajectories = assemble(blobs, len(records), len(checkpoints),
                                              int(cfg["dim"]))
    features, scores, weights = pool_features(projected, norms, checkpoints, records, cfg)
    t_rows, t_recs, t_tasks = _merged_targets(blobs[TARGET_SHARD], shard_paths[TARGET_SHARD],
                                              targets, weights, cfg)
    write_score(_outs(out_features, out_scores, out_trajectories, out_targets, out_target_ids),
                records, features, scores, norms[-1], trajectories, (t_rows, t_recs, t_tasks),
                checked, {**cfg, **lengths}, seed)
    n_targets = len(t_recs) if t_recs is not None else 0
    log.info("merged %d shards: %d examples, %d targets", shards, len(records), n_targets)
    return {"n": len(records), "shards": shards, "n_targets": n_targets,
            "dim": int(features.shape[1]),
            "checkpoint_steps": [int(c["step"]) for c in checkpoints],
            "checkpoint_weights": weights, "warmup_steps": w["info"]["warmup_steps"],
            "warmup_losses": w["info"]["warmup_losses"], **lengths}


def _merged_targets(blob: dict, path: Any, targets: Any, weights: list[float],
                    cfg: dict) -> tuple:
    """(target features, records, tasks) from the target shard, or (None, None, []) without
    targets; a target shard computed without them is refused when targets are asked for."""
    if targets is None:
        return None, None, []
    if "target_projected" not in blob:
        raise InputError("targets were asked for but shard 0 has none: it was computed "
                         "without them", path=str(path), field="targets")
    t_recs = [{"id": str(i)} for i in blob["target_ids"]]
    t_rows = target_features(blob["target_projected"], blob["target_norms"], weights, t_recs,
                             cfg)
    return t_rows, t_recs, [str(t) for t in blob["target_tasks"]]

