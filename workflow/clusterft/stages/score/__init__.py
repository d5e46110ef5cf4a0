"""Per-example gradient features of a briefly warmed-up LoRA model (the LESS recipe).

Pipeline (``compute_features``):

1. **LoRA** (peft) adapters are added to the base model (the ``lora`` section:
   ``r``, ``alpha``, ``dropout``, ``target_modules``), initialised from ``seed``.
2. **Warm-up** (as in LESS): the adapters are trained with AdamW on a seeded random
   ``warmup_fraction`` of the pool for ``warmup_steps`` optimiser steps (or
   ``warmup_epochs`` passes over that subset). Without it every ``lora_B`` is zero, so the
   gradients of every ``lora_A`` are zero too and half the features carry no information.
   With ``warmup_checkpoints: K`` (LESS: one per warm-up epoch) the steps are split into K
   equal consecutive segments and the adapters (and AdamW moments) at the end of each are
   kept: steps 3-4 run at every checkpoint. Along the way every pool example's loss is
   measured at ``loss_points`` evenly spaced steps, 0 (the base model) to the last: the
   loss trajectories that S2L clusters (no-grad eval-mode passes; the warm-up's weights and
   random streams are the same with or without them).
3. **Per-example gradients** of each example's own loss (mean over its response tokens)
   with respect to the LoRA parameters, in ONE batched forward/backward per batch:
   - ``method: hook`` (default): forward hooks keep each LoRA linear layer's input ``x``
     and output ``y``; ``torch.autograd.grad(sum of per-example losses, [y...])`` gives
     every output gradient ``dy``; then ``dW[b] = einsum("bto,bti->boi", dy, x)``. Exact,
     and about one training step of cost (``benchmarks/bench_score.py`` times it against
     a batch-size-1 loop).
   - ``method: func``: ``torch.func.vmap(grad(functional_call))`` over the batch.
   Both match a batch-size-1 loop (tests). Batches are formed from length-sorted
   examples to cut padding (each example's gradient does not depend on its batch mates).
   With ``sparse_logits`` (default) the LM head runs only at the positions that predict a
   response token, here, in the warm-up and in the loss passes: the other positions carry
   no loss, so losses and gradients are the same up to float rounding, for less head work.
   With ``gradient_type: adam`` the gradient is replaced by LESS's Adam-preconditioned
   update direction ``(b1*m + (1-b1)*g) / sqrt(b2*v + (1-b2)*g^2 + eps)`` using the
   warm-up optimiser's moments (``m``, ``v``); ``sgd`` (default) keeps the raw gradient.
4. **Projection**: a seeded dense random matrix ``P`` [D, dim] (Rademacher +-1/sqrt(dim) or
   Gaussian N(0, 1/dim)), generated in fixed chunks of rows from
   ``numpy.random.default_rng([seed, chunk])`` so every machine builds the same matrix,
   maps the flattened LoRA gradient (D values) to ``dim``; rows are then L2-normalised.
   With K checkpoints (same matrix, same batches at each) the rows ``f_k`` of checkpoint k
   are concatenated as ``sqrt(w_k) * f_k``, ``w_k`` = its segment's mean learning rate over
   the sum of them: rows stay unit-norm, the features are ``K * dim`` wide, and the cosine
   of two rows is exactly LESS's lr-weighted sum of per-checkpoint cosines
   (``combine_checkpoints``).
   ``projection: kronecker`` (LoGra, Choe et al. 2024; ``clusterft.stages.score.projection``) instead
   projects each LoRA matrix's gradient ``dW = sum_t dy_t x_t^T`` with two small seeded
   factors to the block ``P_out^T dW P_in``, computed from the projected ``x`` and ``dy``
   (the hook path never forms ``dW``): memory and time per example no longer grow with
   ``D * dim``, the blocks (``dim`` entries in all, an equal share per matrix, the rule in
   ``clusterft.stages.score.projection``) have the dense projection's inner products in expectation.
   It cannot give the Adam direction (elementwise in ``dW``; refused), and its
   ``grad_norm`` is the projected row's norm (see 5).
5. **Scalar score** per example: LESS's influence estimate with the pool itself as the
   target set, i.e. the mean cosine similarity between the example's projected gradient
   and every OTHER pool example's: ``score_i = (f_i . sum_j f_j - 1) / (N - 1)``. High
   means a gradient step on the example also lowers the loss of much of the pool (typical
   examples); low or negative means atypical or conflicting ones. ``grad_norm`` is the L2
   norm of the unprojected per-example vector (the raw gradient, or the Adam direction
   with ``gradient_type: adam``) at the last checkpoint; LESS normalises it away because it
   is larger for short responses. With ``projection: kronecker`` it is the norm of the
   projected row before normalisation (the unprojected gradient is never formed), whose
   square estimates the gradient's squared norm without bias.

6. **Target features** (optional, ``targets``: the benchmark tasks' validation examples,
   ``clusterft.tasks.targets.val_records``; for LESS, ``clusterft.tasks.targets.less_scores``): after
   the pool's gradient pass, the same per-example gradient of each target example at the
   same checkpoints, through the same projection, normalised and combined with the same
   checkpoint weights, so a pool row . a target row is LESS's influence. With
   ``gradient_type: adam`` the targets keep the plain (SGD) gradient, as in LESS's code
   (the Adam direction is a training example's update; a validation example only says
   which way its loss falls). The pool's features are computed first and do not depend on
   the targets (bit for bit the same with or without them).

Sharded (``shards`` > 1, the workflow's score_warmup, score_shard and score rules):
``run_score_warmup`` trains the warm-up once, ``run_score_shard`` computes the rows of a
run of consecutive batches of the gradient pass, ``run_score_merge`` writes the same files
as ``run_score``, bit for bit (the section "sharded scoring" below).

``run_score`` is the stage's file I/O edge: pool JSONL + HF model dir in,
``features.npy`` (float32 [N, warmup_checkpoints * dim], pool order), ``scores.parquet``
(id, score, grad_norm) and, optionally, the loss trajectories (float32 [N, loss_points])
and the target features (float32 [M, warmup_checkpoints * dim]) with their ids and tasks
(parquet) out.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from clusterft.modeling import lora
from clusterft.pipeline import provenance
from clusterft.pipeline.sections import merge_section
from clusterft.modeling.distributed import resolve_device
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.rows import pool_scores
from clusterft.modeling.lora import DEFAULTS as LORA_DEFAULTS
from clusterft.pools.poolfile import load_pool
from clusterft.tasks.targets import check_outputs, resolve_targets, write_outputs

log = logging.getLogger(__name__)

DEFAULTS: dict = {
    # Dimension of the random projection of the flattened LoRA gradient (LESS uses 8192 for
    # 7B models; a few hundred is plenty for the tiny models here).
    "dim": 128,
    # Examples per batched forward/backward (warm-up and gradients).
    "batch_size": 16,
    # Examples are tokenised like training and truncated to this many tokens (response
    # cut at the right first; see clusterft.modeling.tokenize). Every example keeps >= 1 loss token.
    "max_length": 256,
    # LoRA adapters whose gradients are the features (keys in clusterft.modeling.lora; their
    # dropout acts during the warm-up only: gradients are computed in eval mode).
    "lora": copy.deepcopy(LORA_DEFAULTS),
    # Fraction of the pool (seeded random sample) the warm-up trains on (LESS: 5%).
    "warmup_fraction": 0.05,
    # Warm-up optimiser steps; null means use warmup_epochs instead. 0 disables warm-up.
    "warmup_steps": None,
    # Passes over the warm-up subset when warmup_steps is null (LESS: 4 epochs).
    "warmup_epochs": 4,
    # Peak AdamW learning rate of the warm-up (linear warm-up over 3% of steps, then
    # linear decay to 0, no weight decay, as in LESS; higher than LESS's 2e-5 because the
    # models here are tiny).
    "warmup_lr": 1.0e-3,
    # Warm-up checkpoints whose gradients make up the features (LESS: one per warm-up
    # epoch). The warm-up's steps are split into this many equal consecutive segments; the
    # LoRA weights (and AdamW moments) at the end of each are kept, the gradient pass runs
    # at each (same projection, same batches), and each checkpoint's rows f_k are
    # L2-normalised and concatenated as sqrt(w_k) * f_k, w_k = the segment's mean learning
    # rate / the sum over segments. Rows stay unit-norm and the cosine of two rows is LESS's
    # lr-weighted sum of per-checkpoint cosines, so the features are warmup_checkpoints *
    # dim wide. 1 (default): the end of the warm-up only. Needs >= as many warm-up steps.
    "warmup_checkpoints": 1,
    # Points of each example's loss trajectory (for S2L): its mean response-token loss,
    # measured (no-grad, eval mode: the warm-up is unchanged) over the whole pool at this many
    # evenly spaced warm-up steps from 0 (the base model) to the last; run_score writes them
    # to out_trajectories [N, loss_points]. Costs loss_points forward passes over the pool.
    # With no warm-up steps every point is the base model's loss (a warning says so).
    "loss_points": 5,
    # Run the LM head only at the positions that predict a response token (the loss's), in
    # the warm-up, the loss passes and the hook method's gradient pass, for the
    # architectures clusterft.modeling.microbatch.SPARSE_LOGIT_TYPES lists (others: full logits).
    # Same losses and gradients up to float rounding, less head work: the head is a large
    # share of a small model's forward (benchmarks/README.md).
    "sparse_logits": True,
    # Per-example gradient method: hook (captured layer inputs/output-grads + einsum,
    # fastest) or func (torch.func vmap over grad of functional_call).
    "method": "hook",
    # Gradient that is projected: sgd (the raw loss gradient) or adam (LESS's
    # Adam-preconditioned direction from the warm-up optimiser's moments).
    "gradient_type": "sgd",
    # Random projection: rademacher (+-1/sqrt(dim)) or gaussian (N(0, 1/dim)), dense
    # [D, dim] matrices; or kronecker (LoGra): per LoRA matrix two small seeded +-1 factors
    # P_out, P_in and the block P_out^T dW P_in formed from the projected layer inputs and
    # output gradients, so time and memory do not grow with D * dim (dim entries in all, an
    # equal share per matrix: clusterft.stages.score.projection). Same inner products in expectation;
    # not with gradient_type adam (elementwise in dW); grad_norm is then the projected
    # row's norm, an estimate.
    "projection": "rademacher",
    # Attention kernel while scoring: eager, sdpa, or null (keep the model's, sdpa for HF
    # Llama). The two give the same features up to float rounding; which is faster depends
    # on the machine and the model (benchmarks/README.md).
    "attn_implementation": None,
    # Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.
    "device": "auto",
    # Torch intra-op threads; 0 uses run_score's `threads` argument (Snakemake's), else
    # torch's default. Default 1: the score rule books one core, so Snakemake runs as many
    # scoring jobs side by side as there are cores; whether a second thread speeds one job
    # up depends on the CPU and on what else runs (benchmarks/README.md). Raise it for
    # bigger models on more cores.
    "num_threads": 1,
    # Batches of the gradient pass between resumable checkpoints (0 disables): a killed
    # score job keeps its warm-up and the rows done so far in <features>.ckpt/ and resumes
    # from them to the same features (the folder is removed once the features are written).
    "checkpoint_every": 50,
    # Jobs the pool is scored in (the workflow; one GPU each): a score_warmup job trains the
    # warm-up once, score_shard jobs compute the gradient features, loss trajectories (and,
    # in shard 0, the targets) of consecutive runs of the gradient pass's length-sorted
    # batches, and score merges them into the same files, bit for bit, as one job would
    # write (run_score_warmup, run_score_shard, run_score_merge). 1: one score job. At most
    # the pool size.
    "shards": 1,
}

# Keys that change neither the warm-up nor the features: a run may resume across them.
RESUMABLE_ACROSS = ("checkpoint_every", "num_threads", "shards")

METHODS = ("hook", "func")
GRADIENT_TYPES = ("sgd", "adam")
DENSE_PROJECTIONS = ("rademacher", "gaussian")
PROJECTIONS = (*DENSE_PROJECTIONS, "kronecker")
ATTN = (None, "eager", "sdpa")
PROJECTION_CHUNK_ROWS = 4096  # fixed: part of the definition of the projection matrix
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def merge_cfg(cfg: dict | None) -> dict:
    """Return ``cfg`` merged over DEFAULTS; unknown keys and bad values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "score")
    for key, valid in (("method", METHODS), ("gradient_type", GRADIENT_TYPES),
                       ("projection", PROJECTIONS), ("attn_implementation", ATTN)):
        if out[key] not in valid:
            raise InputError(f"unknown value '{out[key]}'; valid: {', '.join(map(str, valid))}",
                             field=f"score.{key}")
    for key in ("dim", "batch_size", "max_length"):
        if int(out[key]) < 1:
            raise InputError(f"must be >= 1, got {out[key]}", field=f"score.{key}")
    if out["projection"] == "kronecker" and out["gradient_type"] == "adam":
        raise InputError("projection 'kronecker' cannot give gradient_type 'adam': LESS's "
                         "Adam direction divides each weight's gradient elementwise by "
                         "sqrt(v), which has no Kronecker (P_out^T dW P_in) form, so it "
                         "needs the whole per-example gradient; use projection rademacher "
                         "or gaussian with adam", field="score.projection")
    if int(out["warmup_checkpoints"]) < 1:
        raise InputError(f"must be >= 1, got {out['warmup_checkpoints']}",
                         field="score.warmup_checkpoints")
    if (int(out["warmup_checkpoints"]) > 1 and out["warmup_steps"] is not None
            and int(out["warmup_steps"]) < int(out["warmup_checkpoints"])):
        raise InputError(f"{out['warmup_checkpoints']} checkpoints need at least as many "
                         f"warm-up steps, got warmup_steps {out['warmup_steps']}",
                         field="score.warmup_checkpoints")
    if not isinstance(out["sparse_logits"], bool):
        raise InputError(f"must be true or false, got {out['sparse_logits']!r}",
                         field="score.sparse_logits")
    if isinstance(out["shards"], bool) or int(out["shards"]) < 1:
        raise InputError(f"must be an integer >= 1, got {out['shards']}", field="score.shards")
    if int(out["loss_points"]) < 2:
        raise InputError(f"must be >= 2, got {out['loss_points']}", field="score.loss_points")
    if not 0 < float(out["warmup_fraction"]) <= 1:
        raise InputError(f"must be in (0, 1], got {out['warmup_fraction']}",
                         field="score.warmup_fraction")
    if out["warmup_steps"] is not None and int(out["warmup_steps"]) < 0:
        raise InputError(f"must be >= 0 or null, got {out['warmup_steps']}",
                         field="score.warmup_steps")
    if out["warmup_steps"] is None and float(out["warmup_epochs"]) < 0:
        raise InputError(f"must be >= 0, got {out['warmup_epochs']}", field="score.warmup_epochs")
    lora.check(out["lora"], "score.lora")
    return out


# --------------------------------------------------------------------------- LoRA + warm-up

def lora_parameters(model) -> list[tuple[str, Any]]:
    """Trainable parameters in ``named_parameters`` order (the feature flattening order).

    Raises if anything but LoRA adapters requires grad (e.g. a model that was not frozen).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise InputError("model has no trainable (LoRA) parameters", field="score.lora.target_modules")
    other = [n for n, _ in params if "lora_" not in n]
    if other:
        raise InputError(f"non-LoRA parameters require grad: {other[:5]}", field="score")
    return params


def _warmup_steps(cfg: dict, n_subset: int) -> int:
    if cfg["warmup_steps"] is not None:
        return int(cfg["warmup_steps"])
    per_epoch = math.ceil(n_subset / int(cfg["batch_size"]))
    return int(math.ceil(float(cfg["warmup_epochs"]) * per_epoch))


def checkpoint_ends(steps: int, n_checkpoints: int) -> list[int]:
    """Warm-up steps after which the checkpoints are taken: the ends of ``n_checkpoints``
    consecutive segments of equal length (segment j ends at step floor(j * steps / n))."""
    return [(j * steps) // n_checkpoints for j in range(1, n_checkpoints + 1)]


def loss_steps(steps: int, points: int) -> list[int]:
    """The ``points`` warm-up steps at which the pool's losses are measured: evenly spaced
    from 0 (before the first step) to ``steps`` (after the last), rounded to the nearest step
    (halves up); with fewer steps than points some steps repeat."""
    if points < 2:
        raise ValueError(f"need >= 2 loss points, got {points}")
    return [(2 * j * steps + points - 1) // (2 * (points - 1)) for j in range(points)]


def checkpoint_weights(checkpoints: Sequence[dict]) -> list[float]:
    """LESS's checkpoint weights: each segment's mean learning rate over their sum (equal
    weights if every mean is zero, as for a warm-up of zero steps)."""
    lrs = [float(c["lr_mean"]) for c in checkpoints]
    total = sum(lrs)
    if total <= 0:
        return [1.0 / len(lrs)] * len(lrs)
    return [lr / total for lr in lrs]


def pool_losses(model, encoded: Sequence[dict], batch_size: int, pad_id: int,
                sparse: bool = False) -> np.ndarray:
    """Each example's :func:`per_example_loss` under ``model`` as it is now: float32 [N] in
    the order of ``encoded``.

    no_grad forward passes over length-sorted batches in eval mode (no dropout, so no RNG
    draw; torch's CPU RNG is forked besides), and the model's train/eval mode is restored:
    measuring leaves a warm-up's weights and random streams exactly as they were.
    ``sparse``: the LM head at the label positions only (:func:`example_losses`).
    """
    import torch

    from clusterft.modeling.tokenize import collate

    device = next(model.parameters()).device
    out = np.zeros(len(encoded), dtype=np.float32)
    order = np.argsort([e["length"] for e in encoded], kind="stable")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for lo in range(0, len(order), batch_size):
                idx = order[lo:lo + batch_size]
                batch = {k: v.to(device)
                         for k, v in collate([encoded[i] for i in idx], pad_id).items()}
                out[idx] = example_losses(model, batch, sparse).float().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def _set_lora(model, values: dict) -> None:
    import torch

    params = dict(lora_parameters(model))
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(value)


def warmup_lora(model, encoded: Sequence[dict], cfg: dict, seed: int, pad_id: int, *,
                ckpt: "Checkpoints | None" = None, snapshots: bool = False) -> dict:
    """Train the LoRA adapters of ``model`` in place on a seeded subset; return metrics.

    Metrics hold the subset size, steps, losses, the learning rate of each step
    (``warmup_lrs``), and:

    - ``checkpoints``: one dict per warm-up checkpoint (``warmup_checkpoints`` of them, at
      the ends of equal consecutive segments of the steps): ``step``, ``lr_mean`` (the mean
      learning rate of its segment), ``lora`` (name -> CPU tensor) and, for
      ``gradient_type: adam``, the AdamW moments there, flattened in ``lora_parameters``
      order (``exp_avg``, ``exp_avg_sq``; else None). Without warm-up steps: one
      checkpoint, the initial adapters.
    - ``exp_avg``, ``exp_avg_sq``: the last checkpoint's moments (None when no step ran).
    - ``loss_trajectories``: float32 [N, loss_points], every example's
      :func:`per_example_loss` at ``loss_points`` evenly spaced steps (:func:`loss_steps`),
      column 0 before the first step (LoRA B is zero: the base model), the last after the
      last step. Measuring (:func:`pool_losses`) changes neither the weights nor the RNG
      streams of the warm-up.

    ``ckpt``: the warm-up's state is kept in ``warmup.pt`` at every checkpoint (the
    checkpoints so far, the optimiser, schedule, data order and RNG states, the losses
    measured so far); a warm-up that was stopped resumes from the last one to the same
    weights, and a finished one is loaded instead of run (``warmup_resumed``).

    ``snapshots`` (sharded scoring, ``run_score_warmup``): instead of measuring the pool's
    losses at the trajectory steps, keep the adapters there (``loss_snapshots``: step ->
    name -> CPU tensor), so that each shard measures its own rows with the same weights.
    """
    import torch

    from clusterft.modeling.optim import adamw, check_finite
    from clusterft.pipeline.pace import Pace
    from clusterft.modeling.tokenize import collate

    cfg = merge_cfg(cfg)
    n = len(encoded)
    rng = np.random.default_rng([seed, 1])
    n_sub = min(n, max(1, round(float(cfg["warmup_fraction"]) * n)))
    subset = np.sort(rng.choice(n, size=n_sub, replace=False))
    steps = _warmup_steps(cfg, n_sub)
    n_ckpt = int(cfg["warmup_checkpoints"])
    if n_ckpt > 1 and steps < n_ckpt:
        raise InputError(f"{n_ckpt} warm-up checkpoints need at least as many warm-up steps, "
                         f"got {steps}", field="score.warmup_checkpoints")
    ends = checkpoint_ends(steps, n_ckpt) if steps else [0]
    at = loss_steps(steps, int(cfg["loss_points"]))
    adam = cfg["gradient_type"] == "adam"
    params = lora_parameters(model)
    loss_bs = int(cfg["batch_size"])
    sparse = use_sparse_logits(model, cfg)
    out: dict = {"warmup_examples": int(n_sub), "warmup_steps": steps, "warmup_losses": [],
                 "warmup_lrs": [], "exp_avg": None, "exp_avg_sq": None, "checkpoints": [],
                 "loss_trajectories": np.full((n, len(at)), np.nan, dtype=np.float32),
                 **({"loss_snapshots": {}} if snapshots else {})}

    def measure(step: int) -> None:
        cols = [j for j, s in enumerate(at) if s == step]
        if cols and snapshots:
            out["loss_snapshots"][step] = {name: p.detach().cpu().clone() for name, p in params}
        elif cols:
            losses = pool_losses(model, encoded, loss_bs, pad_id, sparse)
            out["loss_trajectories"][:, cols] = losses[:, None]

    def take_checkpoint(step: int, opt=None) -> None:
        first = ends[len(out["checkpoints"]) - 1] if out["checkpoints"] else 0
        lrs = out["warmup_lrs"][first:step]
        moments = {key: None for key in ("exp_avg", "exp_avg_sq")}
        if adam and opt is not None:
            st = [opt.state[p] for _, p in params]
            moments = {key: torch.cat([s[key].reshape(-1) for s in st]).detach().cpu().clone()
                       for key in moments}
        out["checkpoints"].append({"step": step, "lr_mean": float(np.mean(lrs)) if lrs else 0.0,
                                   "lora": {name: p.detach().cpu().clone() for name, p in params},
                                   **moments})
        out.update(moments)

    saved = ckpt.load("warmup.pt") if ckpt is not None else None
    if saved is not None:
        out = saved["info"]
        _set_lora(model, out["checkpoints"][-1]["lora"])
    out["warmup_resumed"] = saved is not None
    if saved is not None and saved["state"] is None:  # finished
        model.eval()
        return out
    if steps == 0:
        measure(0)
        if len(at) > 1:
            log.warning("score.warmup_steps is 0: every one of the %d loss-trajectory points "
                        "is the base model's loss", len(at))
        take_checkpoint(0)
        if ckpt is not None:
            ckpt.save("warmup.pt", {"info": out, "state": None})
        return out
    device = params[0][1].device
    opt, sched = adamw([p for _, p in params], lr=cfg["warmup_lr"], weight_decay=0.0,
                       betas=ADAM_BETAS, eps=ADAM_EPS, schedule="linear",
                       warmup=max(1, round(0.03 * steps)), total=steps, floor=0.0)
    bs = min(int(cfg["batch_size"]), n_sub)
    order, pos, start = rng.permutation(subset), 0, 0
    state = saved["state"] if saved is not None else None
    if state is not None:
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        rng.bit_generator.state = state["rng"]
        order, pos, start = state["order"], state["pos"], state["step"]
    model.train()
    with torch.random.fork_rng(devices=[]):  # lora dropout draws from the global RNG
        torch.manual_seed(seed)
        if state is not None:
            torch.set_rng_state(state["torch_rng"])
            if state.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(state["cuda_rng"], device)
        if start == 0:
            measure(0)
        with Pace(steps, "score warm-up", initial=start, disable=steps - start < 2) as pace:
            for step in range(start, steps):
                if pos >= len(order):  # next epoch (the last batch of one may be short)
                    order, pos = rng.permutation(subset), 0
                batch = collate([encoded[i] for i in order[pos:pos + bs]], pad_id)
                pos += bs
                batch = {k: v.to(device) for k, v in batch.items()}
                loss = batch_loss(model, batch, sparse)
                loss.backward()
                value = float(loss.detach())
                check_finite(value, None, step=len(out["warmup_losses"]) + 1, total=steps,
                             run="score warm-up", lr_field="score.warmup_lr",
                             lr=float(cfg["warmup_lr"]))
                out["warmup_lrs"].append(float(opt.param_groups[0]["lr"]))
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                out["warmup_losses"].append(round(value, 5))
                pace.update()
                measure(step + 1)
                if step + 1 in ends:
                    take_checkpoint(step + 1, opt)
                    if ckpt is not None:
                        last = step + 1 == steps
                        ckpt.save("warmup.pt", {"info": out, "state": None if last else {
                            "step": step + 1, "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "rng": rng.bit_generator.state,
                            "order": order, "pos": pos, "torch_rng": torch.get_rng_state(),
                            "cuda_rng": (torch.cuda.get_rng_state(device)
                                         if device.type == "cuda" else None)}})
    model.eval()
    return out


# --------------------------------------------------------------------------- per-example gradients

def per_example_loss(logits, labels):
    """Each example's mean next-token loss over its labelled tokens ([B]; 0 if none)."""
    import torch.nn.functional as F

    lg, lb = logits[:, :-1], labels[:, 1:]
    tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lb.reshape(-1),
                          ignore_index=-100, reduction="none").view(lb.shape)
    mask = (lb != -100).to(tok.dtype)
    return (tok * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def use_sparse_logits(model, cfg: dict) -> bool:
    """Whether ``cfg["sparse_logits"]`` applies to ``model``'s architecture."""
    from clusterft.modeling.microbatch import sparse_logits_apply

    return sparse_logits_apply(model, cfg.get("sparse_logits"))


def example_losses(model, batch: dict, sparse: bool):
    """Each example's :func:`per_example_loss` ([B]) under ``model``; with ``sparse`` from
    ``clusterft.modeling.microbatch.label_logits`` (the same values up to float rounding)."""
    import torch
    import torch.nn.functional as F

    if not sparse:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits
        return per_example_loss(logits, batch["labels"])
    from clusterft.modeling.microbatch import label_logits

    logits, target, keep = label_logits(model, batch["input_ids"], batch["attention_mask"],
                                        batch["labels"])
    tok = F.cross_entropy(logits.float(), target, reduction="none")
    count = keep.sum(1).to(tok.dtype)
    sums = torch.zeros(len(count), dtype=tok.dtype, device=tok.device)
    return sums.index_add_(0, keep.nonzero()[:, 0], tok) / count.clamp_min(1.0)


def batch_loss(model, batch: dict, sparse: bool):
    """The batch's mean next-token loss over all its label tokens (HF's ``.loss``); with
    ``sparse`` from ``clusterft.modeling.microbatch.label_logits``."""
    import torch.nn.functional as F

    if not sparse:
        return model(**batch, use_cache=False).loss
    from clusterft.modeling.microbatch import label_logits

    logits, target, _ = label_logits(model, batch["input_ids"], batch["attention_mask"],
                                     batch["labels"])
    return F.cross_entropy(logits.float(), target)


def _check_right_padded(batch: dict) -> None:
    import torch

    am = batch["attention_mask"]
    pos = torch.arange(am.shape[1], device=am.device)[None, :]
    if not bool(((pos < am.sum(1, keepdim=True)).to(am.dtype) == am).all()):
        raise ValueError("per-example gradients need right-padded batches")


def _hook_capture(model, batch: dict, sparse: bool = False
                  ) -> tuple[list[tuple[str, str]], dict[str, list]]:
    """One batched forward/backward for the hook method: (plan, calls). ``plan``: (module
    name, "weight"|"bias") per trainable parameter, in parameter order; ``calls``: module
    name -> one (input x, output gradient dy) per call of the module in the forward pass.

    Every trainable parameter must be the weight (or bias) of an ``nn.Linear`` (peft LoRA
    linear adapters); anything else raises (use ``method: func``). ``sparse``: the LM head
    at the label positions only (:func:`example_losses`; the same gradients up to rounding).
    """
    import torch

    params = lora_parameters(model)
    modules = dict(model.named_modules())
    plan: list[tuple[str, str]] = []  # (module name, "weight"|"bias") in parameter order
    for name, _ in params:
        mod_name, attr = name.rsplit(".", 1)
        mod = modules.get(mod_name)
        if not isinstance(mod, torch.nn.Linear) or attr not in ("weight", "bias"):
            raise InputError(f"method 'hook' supports LoRA linear layers only, not '{name}'; "
                             "use method: func", field="score.method")
        plan.append((mod_name, attr))
    captured: dict[str, list] = {m: [] for m, _ in plan}

    def make_hook(key: str) -> Callable:
        def hook(_mod, inputs, output):
            captured[key].append((inputs[0], output))
        return hook

    handles = [modules[m].register_forward_hook(make_hook(m)) for m in captured]
    try:
        with torch.enable_grad():
            loss = example_losses(model, batch, sparse).sum()
    finally:
        for h in handles:
            h.remove()
    keys = [(m, i) for m in captured for i in range(len(captured[m]))]
    if not keys:
        raise RuntimeError("no LoRA layer ran in the forward pass")
    outs = [captured[m][i][1] for m, i in keys]
    gouts = dict(zip(keys, torch.autograd.grad(loss, outs)))
    return plan, {m: [(x, gouts[(m, i)]) for i, (x, _) in enumerate(captured[m])]
                  for m in captured}


def _as_3d(t):
    return t.reshape(t.shape[0], -1, t.shape[-1])


def grads_hook(model, batch: dict, sparse: bool = False):
    """Per-example LoRA gradients [B, D] from one batched forward/backward (hook method):
    ``dW[b] = einsum("bto,bti->boi", dy, x)`` per LoRA linear layer (``_hook_capture``)."""
    import torch

    plan, calls = _hook_capture(model, batch, sparse)
    cols = []
    for mod_name, attr in plan:
        g = None
        for x, dy in calls[mod_name]:
            x3, dy3 = _as_3d(x), _as_3d(dy)
            gi = (torch.einsum("bto,bti->boi", dy3, x3) if attr == "weight" else dy3.sum(1))
            g = gi if g is None else g + gi
        cols.append(g.reshape(g.shape[0], -1))
    return torch.cat(cols, dim=1).detach()


def grads_hook_kronecker(model, batch: dict, proj, sparse: bool = False):
    """Kronecker-projected per-example LoRA gradients [B, proj.dim] (float32) from the hook
    method's captured factors: each layer's ``x`` and ``dy`` go to
    ``proj.project_layer`` (``clusterft.stages.score.projection.KroneckerProjector``), which projects
    them before their product over tokens, so no per-example [d_out, d_in] gradient is
    formed. Equal to ``proj(grads_hook(model, batch))`` up to float rounding."""
    import torch

    plan, calls = _hook_capture(model, batch, sparse)
    parts = []
    with torch.no_grad():
        for i, (mod_name, attr) in enumerate(plan):
            block = None
            for x, dy in calls[mod_name]:
                bi = proj.project_layer(i, _as_3d(x) if attr == "weight" else None, _as_3d(dy))
                block = bi if block is None else block + bi
            parts.append(block)
        return proj.finish(parts)


def grads_func(model, batch: dict):
    """Per-example LoRA gradients [B, D] with ``torch.func.vmap(grad(functional_call))``.

    Needs right padding: each example runs without an attention mask (HF's mask code is
    data-dependent and cannot be vmapped); with causal attention, real tokens never see
    the padding that follows them, and padded positions carry no loss.
    """
    import torch
    from torch.func import functional_call, grad, vmap

    _check_right_padded(batch)
    names = [n for n, _ in lora_parameters(model)]
    values = {n: p.detach() for n, p in model.named_parameters() if n in set(names)}

    def loss_fn(p: dict, ids, labels):
        out = functional_call(model, p, args=(), kwargs={"input_ids": ids[None]})
        return per_example_loss(out.logits, labels[None])[0]

    with torch.enable_grad():
        g = vmap(grad(loss_fn), in_dims=(None, 0, 0))(values, batch["input_ids"], batch["labels"])
    return torch.cat([g[n].reshape(g[n].shape[0], -1) for n in names], dim=1).detach()


def grads_loop(model, batch: dict):
    """Reference: per-example LoRA gradients [B, D], one unpadded example at a time."""
    import torch

    params = [p for _, p in lora_parameters(model)]
    rows = []
    lengths = batch["attention_mask"].sum(1).tolist()
    for b, length in enumerate(lengths):
        with torch.enable_grad():
            logits = model(input_ids=batch["input_ids"][b:b + 1, :length]).logits
            loss = per_example_loss(logits, batch["labels"][b:b + 1, :length])[0]
            gr = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1)
                               for x, p in zip(gr, params)]))
    return torch.stack(rows)


GRAD_FNS = {"hook": grads_hook, "func": grads_func, "loop": grads_loop}


def per_example_grads(model, batch: dict, method: str = "hook", sparse: bool = False):
    """Per-example gradients [B, D] of each example's mean response loss (LoRA params).
    ``sparse`` (hook only): the LM head at the label positions only."""
    if method not in GRAD_FNS:
        raise InputError(f"unknown method '{method}'; valid: {', '.join(GRAD_FNS)}",
                         field="score.method")
    if method == "hook":
        return grads_hook(model, batch, sparse)
    return GRAD_FNS[method](model, batch)


def adam_direction(g, exp_avg, exp_avg_sq):
    """LESS's Adam-preconditioned per-example direction from warm-up moments m, v."""
    b1, b2 = ADAM_BETAS
    m = b1 * exp_avg + (1 - b1) * g
    v = b2 * exp_avg_sq + (1 - b2) * g * g
    return m / (v + ADAM_EPS).sqrt()


# --------------------------------------------------------------------------- projection

class Projector:
    """Seeded dense random projection R^D -> R^dim, identical on every machine.

    Row chunk c (rows ``c*4096 ...``) of the [D, dim] float32 matrix is drawn from
    ``numpy.random.default_rng([seed, c])``: Rademacher +-1/sqrt(dim) or Gaussian
    N(0, 1/dim), so ``E|Pg|^2 = |g|^2``. Chunks are cached up to ``cache_bytes`` and
    regenerated on the fly beyond that.
    """

    def __init__(self, d: int, dim: int, seed: int, kind: str = "rademacher",
                 device: str = "cpu", cache_bytes: int = 1 << 30) -> None:
        if kind not in DENSE_PROJECTIONS:
            raise InputError(f"unknown dense projection '{kind}'; valid: "
                             f"{', '.join(DENSE_PROJECTIONS)} (kronecker: "
                             "clusterft.stages.score.projection.KroneckerProjector)",
                             field="score.projection")
        if seed < 0:
            raise InputError(f"seed must be >= 0, got {seed}", field="seed")
        self.d, self.dim, self.seed, self.kind, self.device = int(d), int(dim), int(seed), kind, device
        self.n_chunks = math.ceil(self.d / PROJECTION_CHUNK_ROWS)
        self.cache = 4 * self.d * self.dim <= cache_bytes
        self._chunks: dict[int, Any] = {}

    def chunk(self, c: int):
        """Rows ``[c*4096, min(D, (c+1)*4096))`` of the matrix as a float32 tensor."""
        import torch

        if c in self._chunks:
            return self._chunks[c]
        rows = min(self.d, (c + 1) * PROJECTION_CHUNK_ROWS) - c * PROJECTION_CHUNK_ROWS
        rng = np.random.default_rng([self.seed, c])
        scale = np.float32(1.0 / math.sqrt(self.dim))
        if self.kind == "rademacher":
            m = (rng.integers(0, 2, size=(rows, self.dim), dtype=np.int8) * 2 - 1).astype(np.float32)
        else:
            m = rng.standard_normal(size=(rows, self.dim), dtype=np.float32)
        t = torch.from_numpy(m * scale).to(self.device)
        if self.cache:
            self._chunks[c] = t
        return t

    def matrix(self):
        """The whole [D, dim] matrix (for tests and small D)."""
        import torch

        return torch.cat([self.chunk(c) for c in range(self.n_chunks)], dim=0)

    def __call__(self, g):
        """Project gradients [B, D] -> [B, dim] (float32)."""
        if g.shape[1] != self.d:
            raise ValueError(f"gradient has {g.shape[1]} columns, projector expects {self.d}")
        g = g.float()
        out = None
        for c in range(self.n_chunks):
            lo = c * PROJECTION_CHUNK_ROWS
            part = g[:, lo:lo + PROJECTION_CHUNK_ROWS] @ self.chunk(c)
            out = part if out is None else out + part
        return out


def make_projector(model, cfg: dict, seed: int, device: Any = "cpu"):
    """The projection ``cfg["projection"]`` names for ``model``'s LoRA parameters: a dense
    :class:`Projector` [D, dim], or a ``clusterft.stages.score.projection.KroneckerProjector`` over their
    shapes (in ``lora_parameters`` order)."""
    params = lora_parameters(model)
    if cfg["projection"] == "kronecker":
        from clusterft.stages.score.projection import KroneckerProjector

        return KroneckerProjector([tuple(p.shape) for _, p in params], int(cfg["dim"]), seed,
                                  device)
    return Projector(sum(p.numel() for _, p in params), int(cfg["dim"]), seed,
                     cfg["projection"], device)


def project_batch(model, batch: dict, cfg: dict, proj, moments=None):
    """(projected rows [B, dim] float32, grad norms [B]) of one batch.

    Dense: the per-example gradients (``cfg["method"]``), Adam directions when ``moments``
    (exp_avg, exp_avg_sq) are given, their norms and ``proj`` of them. Kronecker: with
    method hook the blocks straight from the captured factors (:func:`grads_hook_kronecker`),
    otherwise ``proj`` of the formed gradients; the norms are the projected rows' (the
    gradient is not formed; ``E|f|^2 = |g|^2``).
    """
    sparse = use_sparse_logits(model, cfg)
    if cfg["projection"] == "kronecker":
        if moments is not None:
            raise InputError("projection 'kronecker' cannot give the Adam direction",
                             field="score.projection")
        rows = (grads_hook_kronecker(model, batch, proj, sparse) if cfg["method"] == "hook"
                else proj(per_example_grads(model, batch, cfg["method"])))
        return rows, rows.norm(dim=1)
    g = per_example_grads(model, batch, cfg["method"], sparse)
    if moments is not None:
        g = adam_direction(g, *moments)
    return proj(g), g.norm(dim=1)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows raise: they have no direction)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        bad = np.flatnonzero(norms[:, 0] == 0)[:5].tolist()
        raise ValueError(f"zero gradient for rows {bad}: cannot normalise")
    return (x / norms).astype(np.float32)


# --------------------------------------------------------------------------- features

def compute_features_info(model, tokenizer, examples: Sequence[dict], cfg: dict | None,
                          seed: int = 0, ckpt: "Checkpoints | None" = None,
                          targets: Sequence[dict] | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """``compute_features`` plus an info dict (warm-up losses, timings, truncation count,
    ``checkpoint_steps`` and ``checkpoint_weights``, and ``loss_trajectories``: float32
    [N, loss_points] in the order of ``examples``).
    ``ckpt``: where the warm-up and the gradient pass keep resumable progress.
    ``targets``: records (pool format) whose features come from the same warm-up and
    projection after the pool's (step 6 of the module docstring): ``target_features``
    (float32 [M, warmup_checkpoints * dim], in the order of ``targets``) and
    ``targets_truncated`` in the info."""
    import torch

    cfg = merge_cfg(cfg)
    if len(examples) == 0:
        raise InputError("no examples to score", field="pool")
    if targets is not None and len(targets) == 0:
        raise InputError("no target examples (targets is empty)", field="targets")
    base_threads = torch.get_num_threads()
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    try:
        return _compute(model, tokenizer, examples, cfg, seed, ckpt, targets)
    finally:
        torch.set_num_threads(base_threads)


class Checkpoints:
    """Resumable progress of one score run: ``warmup.pt`` (every warm-up checkpoint taken
    so far, LoRA weights and Adam moments, the losses measured so far and, while the
    warm-up is unfinished, what it needs to go on) and ``gradients.pt`` (the rows of every
    checkpoint done so far and where the pass stands), each replaced
    atomically and used only by a run with the same fingerprint (config, seed, model, pool)."""

    def __init__(self, folder: str | os.PathLike, fingerprint: str) -> None:
        self.dir, self.fp = Path(folder), fingerprint

    def load(self, name: str) -> dict | None:
        import warnings

        import torch

        f = self.dir / name
        if not f.exists():
            return None
        blob = torch.load(f, map_location="cpu", weights_only=False)
        if blob.get("fingerprint") != self.fp:
            warnings.warn(f"{f}: progress of a different score run (config, seed, model or pool "
                          "differ); starting over", stacklevel=2)
            return None
        log.info("resuming from %s", f)
        return blob

    def save(self, name: str, blob: dict) -> None:
        import torch

        from clusterft.pipeline.io import atomic_path

        with atomic_path(self.dir / name) as tmp:
            torch.save({"fingerprint": self.fp, **blob}, tmp)


def score_fingerprint(cfg: dict, seed: int, model_digest: str, pool_digest: str) -> str:
    import hashlib
    import json

    keep = {k: v for k, v in cfg.items() if k not in RESUMABLE_ACROSS}
    return hashlib.sha1(json.dumps({"cfg": keep, "seed": seed, "model": model_digest,
                                    "pool": pool_digest}, sort_keys=True,
                                   default=str).encode()).hexdigest()


def _encode_all(tokenizer, examples: Sequence[dict], cfg: dict, what: str = "examples"
                ) -> tuple[list[dict], int]:
    from clusterft.modeling.tokenize import encode_truncated

    return encode_truncated(tokenizer, examples, int(cfg["max_length"]), what)


def _target_pass(pmodel, encoded: Sequence[dict], checkpoints: Sequence[dict], proj,
                 cfg: dict, pad_id: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Projected plain (SGD) gradients of the target examples at every checkpoint:
    ([checkpoint, example, dim], [checkpoint, example] norms), length-sorted batches."""
    from clusterft.modeling.tokenize import collate

    n, bs = len(encoded), int(cfg["batch_size"])
    order = np.argsort([e["length"] for e in encoded], kind="stable")
    projected = np.zeros((len(checkpoints), n, int(cfg["dim"])), dtype=np.float32)
    norms = np.zeros((len(checkpoints), n), dtype=np.float32)
    for k, c in enumerate(checkpoints):
        _set_lora(pmodel, c["lora"])
        for lo in range(0, n, bs):
            idx = order[lo:lo + bs]
            batch = {key: v.to(device) for key, v in
                     collate([encoded[i] for i in idx], pad_id).items()}
            rows, nrm = project_batch(pmodel, batch, cfg, proj)  # LESS: SGD for targets
            norms[k, idx] = nrm.cpu().numpy()
            projected[k, idx] = rows.cpu().numpy()
    return projected, norms


def _compute(model, tokenizer, examples: Sequence[dict], cfg: dict, seed: int,
             ckpt: Checkpoints | None = None, targets: Sequence[dict] | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    from clusterft.pipeline.pace import Pace
    from clusterft.modeling.tokenize import collate

    device = resolve_device(cfg["device"], "score.device")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise InputError("tokenizer has no pad token", field="model")
    t0 = time.perf_counter()
    encoded, n_trunc = _encode_all(tokenizer, examples, cfg)
    enc_targets, t_trunc = (_encode_all(tokenizer, targets, cfg, "targets")
                            if targets is not None else (None, 0))

    model.to(device)
    base_training = model.training
    base_requires_grad = [p.requires_grad for p in model.parameters()]
    base_attn = getattr(model.config, "_attn_implementation", None)
    if cfg["attn_implementation"] and cfg["attn_implementation"] != base_attn:
        model.set_attn_implementation(cfg["attn_implementation"])
    pmodel = None
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        pmodel = lora.add_lora(model, cfg["lora"], "score.lora", seed)
        # Before the warm-up, so a dim that kronecker cannot split fails at once (the
        # matrices come from numpy streams of their own: no torch RNG is drawn).
        proj = make_projector(pmodel, cfg, seed, device)
        info = warmup_lora(pmodel, encoded, cfg, seed, pad_id, ckpt=ckpt)
        t_warm = time.perf_counter() - t0
        if cfg["gradient_type"] == "adam" and info["exp_avg"] is None:
            raise InputError("gradient_type 'adam' needs a warm-up (warmup_steps > 0)",
                             field="score.gradient_type")
        pmodel.eval()
        d = sum(p.numel() for _, p in lora_parameters(pmodel))
        order = np.argsort([e["length"] for e in encoded], kind="stable")
        bs, n = int(cfg["batch_size"]), len(encoded)
        checkpoints = info["checkpoints"]
        n_ckpt = len(checkpoints)
        # Rows of every checkpoint: [checkpoint, example, dim] and [checkpoint, example].
        projected = np.zeros((n_ckpt, n, int(cfg["dim"])), dtype=np.float32)
        norms = np.zeros((n_ckpt, n), dtype=np.float32)
        k0, start = 0, 0
        done = ckpt.load("gradients.pt") if ckpt is not None else None
        if done is not None:
            k0, start = done["checkpoint"], done["next"]
            projected, norms = done["projected"], done["norms"]
        every = int(cfg["checkpoint_every"]) * bs if ckpt is not None else 0
        info["gradients_resumed_at"] = ({"checkpoint": k0, "row": start}
                                        if done is not None else None)
        per_pass = math.ceil(n / bs)
        left = (n_ckpt - k0) * per_pass - start // bs
        # Batches go shortest first, so the expected finish of the first pace lines is early.
        with Pace(left, "score gradients", unit="batch", units="batches",
                  disable=left <= 1) as pace:
            for k in range(k0, n_ckpt):
                _set_lora(pmodel, checkpoints[k]["lora"])
                moments = (tuple(checkpoints[k][key].to(device)
                                 for key in ("exp_avg", "exp_avg_sq"))
                           if cfg["gradient_type"] == "adam" else None)
                for lo in range(start if k == k0 else 0, n, bs):
                    idx = order[lo:lo + bs]
                    batch = {key: v_.to(device) for key, v_ in
                             collate([encoded[i] for i in idx], pad_id).items()}
                    rows, nrm = project_batch(pmodel, batch, cfg, proj, moments)
                    norms[k, idx] = nrm.cpu().numpy()
                    projected[k, idx] = rows.cpu().numpy()
                    refuse_rows(idx[~np.isfinite(projected[k, idx]).all(1)],
                                "non-finite gradients",
                                "the warm-up diverged or the model overflows", examples, cfg)
                    pace.update()
                    if every and (lo + bs) % every == 0 and lo + bs < n:
                        ckpt.save("gradients.pt", {"checkpoint": k, "next": lo + bs,
                                                   "projected": projected, "norms": norms})
                if ckpt is not None and k + 1 < n_ckpt:
                    ckpt.save("gradients.pt", {"checkpoint": k + 1, "next": 0,
                                               "projected": projected, "norms": norms})
        if enc_targets is not None:  # after the pool's rows: they cannot depend on it
            t_proj, t_norms = _target_pass(pmodel, enc_targets, checkpoints, proj, cfg,
                                           pad_id, device)
    finally:
        if pmodel is not None:
            pmodel.unload()  # remove the adapters: the caller's model is left as it was
        model.train(base_training)
        for p, flag in zip(model.parameters(), base_requires_grad):
            p.requires_grad_(flag)
        if base_attn and getattr(model.config, "_attn_implementation", None) != base_attn:
            model.set_attn_implementation(base_attn)
    features, scores, weights = pool_features(projected, norms, checkpoints, examples, cfg)
    if enc_targets is not None:
        info["target_features"] = target_features(t_proj, t_norms, weights, targets, cfg)
        info["targets_truncated"] = t_trunc
    for key in ("exp_avg", "exp_avg_sq", "checkpoints"):
        info.pop(key, None)
    info.update({"n": len(encoded), "truncated": n_trunc, "lora_dim": d,
                 "dim": int(features.shape[1]), "projection_dim": int(cfg["dim"]),
                 "projection": cfg["projection"],
                 **({"projection_blocks": proj.blocks(), "projection_pad": proj.pad}
                    if cfg["projection"] == "kronecker" else {}),
                 "checkpoint_steps": [int(c["step"]) for c in checkpoints],
                 "checkpoint_weights": weights, "method": cfg["method"], "device": device,
                 "warmup_seconds": round(t_warm, 2),
                 "seconds": round(time.perf_counter() - t0, 2)})
    return features, scores, norms[-1], info


def pool_features(projected, norms, checkpoints, records, cfg) -> tuple:
    """The pool's feature rows from its per-checkpoint projected gradients (one job's or the
    merged shards'): rows with a zero gradient refused, each checkpoint L2-normalised and
    combined with its learning-rate weight. Returns (features, scores, weights)."""
    refuse_rows(np.flatnonzero((norms == 0).any(0)), "zero gradient",
                "their loss no longer depends on the LoRA weights, as after a warm-up that "
                "diverged into a saturated model", records, cfg)
    weights = checkpoint_weights(checkpoints)
    features = combine_checkpoints([l2_normalize(p) for p in projected], weights)
    return features, pool_scores(features), weights


def target_features(t_proj, t_norms, weights, records, cfg) -> np.ndarray:
    """The validation targets' feature rows, combined like the pool's (non-finite or zero
    target gradients refused)."""
    refuse_rows(np.flatnonzero(~np.isfinite(t_proj).all(2).all(0)), "non-finite target "
                "gradients", "the warm-up diverged or the model overflows", records, cfg)
    refuse_rows(np.flatnonzero((t_norms == 0).any(0)), "zero target gradient",
                "their loss does not depend on the LoRA weights", records, cfg)
    return combine_checkpoints([l2_normalize(p) for p in t_proj], weights)


def combine_checkpoints(rows: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Features of several warm-up checkpoints: ``concat_k sqrt(w_k) * f_k`` (float32).

    With unit-norm per-checkpoint rows ``f_k`` and weights summing to 1 the rows stay
    unit-norm, and the dot product (cosine) of two rows is exactly
    ``sum_k w_k * cos_k``: LESS's influence, the learning-rate-weighted sum of the
    per-checkpoint cosine similarities (with normalised weights). Concatenating rather than
    summing the ``f_k`` keeps that identity (a sum would add cross-checkpoint terms
    ``f_k . f'_l``), so clustering and pool scores see LESS's similarity. One checkpoint:
    its rows unchanged.
    """
    if len(rows) == 1:
        return rows[0]
    return np.concatenate([np.float32(math.sqrt(w)) * f for w, f in zip(weights, rows)],
                          axis=1).astype(np.float32)


def refuse_rows(rows: np.ndarray, what: str, why: str, examples: Sequence[dict],
                cfg: dict) -> None:
    """DivergedError naming the examples whose gradient rows are unusable (none: return)."""
    if not len(rows):
        return
    from clusterft.modeling.optim import DivergedError

    ids = [examples[i].get("id", int(i)) for i in rows[:5]]
    raise DivergedError(f"{what} for {len(rows)} of {len(examples)} examples (ids {ids}): "
                        f"{why}; lower score.warmup_lr (now {cfg['warmup_lr']:g})",
                        field="score.warmup_lr")


def compute_features(model, tokenizer, examples: Sequence[dict], cfg: dict | None,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient features of pool examples: (features [N, warmup_checkpoints * dim] float32
    L2-normalised rows, scores [N], grad_norms [N]), all in the order of ``examples``.

    ``model`` is a base causal LM (HF ``LlamaForCausalLM`` or similar); LoRA adapters are
    added, warmed up and removed again, so the model is unchanged on return (weights,
    modules, requires_grad flags, attention kernel; it is moved to ``device`` though).
    ``examples`` are pool records
    (``messages`` lists). Deterministic in ``seed`` (adapter init, warm-up subset and
    order, projection).
    """
    features, scores, norms, _ = compute_features_info(model, tokenizer, examples, cfg, seed)
    return features, scores, norms


def run_score(model_dir: str | os.PathLike, pool: str | os.PathLike, cfg: dict | None,
              out_features: str | os.PathLike, out_scores: str | os.PathLike, seed: int = 0,
              threads: int | None = None, length_policy: dict | None = None,
              out_trajectories: str | os.PathLike | None = None, targets: Any = None,
              out_targets: str | os.PathLike | None = None,
              out_target_ids: str | os.PathLike | None = None) -> dict:
    """Stage `score`: write features.npy [N, warmup_checkpoints * dim] and scores.parquet
    (id, score, grad_norm), and with ``out_trajectories`` the loss trajectories (float32
    [N, loss_points] .npy, pool order; output role "trajectories" in the provenance).

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
    before the model loads, so an over-long example under 'error' (or a pool that 'reject'
    would empty) stops the run here rather than at train.
    Returns the info dict (warm-up losses, timings, truncation count) without the
    trajectory array (``compute_features_info`` returns it).
    """
    import pandas as pd
    import torch

    from clusterft.modeling.hf import load_causal_lm, load_tokenizer, resolve_model
    from clusterft.pipeline.io import save_npy, set_offline_env, write_parquet
    from clusterft.modeling.tokenize import LENGTH_POLICY, check_length_policy

    set_offline_env()
    cfg = merge_cfg(cfg)
    check_outputs(targets, out_targets, out_target_ids)
    if threads and not cfg["num_threads"]:
        torch.set_num_threads(int(threads))
    records = load_pool(pool)
    t_records, t_tasks, t_dirs = resolve_targets(targets) if targets is not None else (None, [], [])
    path = resolve_model(str(model_dir), field="score model")
    checked = provenance.check_inputs({"model": path, "pool": pool, "items": t_dirs or None},
                                      "score")
    tok = load_tokenizer(path)
    if length_policy is not None:
        policy = {**LENGTH_POLICY, **length_policy}
        counts = check_length_policy(tok, records, int(policy["max_length"]),
                                     str(policy["truncation"]), str(pool))
        log.info("train length check: %d of %d examples longer than max_length = %s (%s)",
                 counts["too_long"], counts["n"], policy["max_length"], policy["truncation"])
    model = load_causal_lm(path)
    ckpt_dir = Path(str(out_features) + ".ckpt")
    ckpt = Checkpoints(ckpt_dir, score_fingerprint(cfg, seed, provenance.digest(path),
                                                   provenance.digest(pool))
                       ) if int(cfg["checkpoint_every"]) > 0 else None
    features, scores, norms, info = compute_features_info(model, tok, records, cfg, seed, ckpt,
                                                          t_records)
    save_npy(out_features, features)
    write_parquet(out_scores, pd.DataFrame({"id": [r["id"] for r in records],
                                            "score": scores.astype(np.float64),
                                            "grad_norm": norms.astype(np.float64)}))
    trajectories = info.pop("loss_trajectories")
    outputs = {"features": out_features, "scores": out_scores}
    if out_trajectories is not None:
        save_npy(out_trajectories, trajectories)
        outputs["trajectories"] = out_trajectories
    if out_targets is not None:
        outputs.update(write_outputs(out_targets, out_target_ids,
                                     info.pop("target_features", None), t_records, t_tasks,
                                     features.shape[1]))
        info["n_targets"] = len(t_records or [])
    provenance.write(outputs, "score", checked, inherit=("pool", "model", "items"),
                     run_key="score_run", config=cfg, seed=seed)
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # the features are complete
    log.info("scored %d examples in %.1fs (warm-up %.1fs, %d truncated)", info["n"],
             info["seconds"], info["warmup_seconds"], info["truncated"])
    return info

# --------------------------------------------------------------------------- sharded scoring
# Scoring the pool in several jobs (``shards``): one warm-up, N shards, one merge.
#
# ``run_score`` does everything in one process. For big pools the workflow
# splits it (each job one GPU):
#
# 1. :func:`run_score_warmup` (rule ``score_warmup``): the LoRA warm-up, once. It writes
#    ``warmup.safetensors``: the adapters (and, for ``gradient_type: adam``, the AdamW
#    moments) at every warm-up checkpoint, the adapters at every loss-trajectory step
#    (instead of measuring the whole pool's losses there), every pool example's token length
#    and, as JSON metadata, the warm-up's numbers (steps, losses, learning rates, checkpoint
#    steps and learning-rate means) and the fingerprint of its config, seed, model and pool.
# 2. :func:`run_score_shard` (rule ``score_shard``, N jobs): the gradient pass and the loss
#    trajectories of one shard. A shard is a run of consecutive *batches* of the one-job
#    gradient pass (the pool sorted by length, cut into ``batch_size`` batches;
#    :func:`shard_bounds` cuts the batches so that each shard gets about the same number of
#    padded tokens). A shard's batches are exactly the one-job run's, so every number is
#    computed from the same operands in the same order: the merge equals the one-job output
#    bit for bit (a slice of the pool in pool order would batch examples differently, and a
#    batched matmul's rounding depends on its batch). Shard 0 also computes the targets (the
#    validation examples' features). Output: ``shard<i>.npz`` (numpy, open format): the
#    pool rows it holds, their raw projected gradients per checkpoint, gradient norms and
#    loss trajectories.
# 3. :func:`run_score_merge` (rule ``score``): checks the shards cover the pool once and come
#    from one warm-up (provenance lineage ``score_warmup``), then normalises, combines the
#    checkpoints, scores and writes the same files as ``run_score`` (features.npy,
#    scores.parquet, trajectories.npy, targets.npy, targets.parquet and their sidecars).
#
# Each job resumes after a kill: the warm-up from ``<warmup>.ckpt/``, a shard from
# ``<shard>.ckpt/`` (as ``run_score`` does from ``<features>.ckpt/``).

WARMUP_FORMAT = "clusterft-score-warmup/1"
SHARD_FORMAT = "clusterft-score-shard/1"
TARGET_SHARD = 0  # the shard that also computes the targets' features


def shard_bounds(lengths: Sequence[int], batch_size: int, shards: int) -> list[tuple[int, int]]:
    """Each shard's rows ``[lo, hi)`` of the length-sorted pool (``np.argsort(lengths,
    kind="stable")``): consecutive, covering every row once, cut only between the gradient
    pass's batches (multiples of ``batch_size``), each shard with about ``1/shards`` of
    the padded tokens (batch size times its longest example). More shards than batches
    leaves some empty."""
    n, bs, shards = len(lengths), int(batch_size), int(shards)
    if shards < 1 or bs < 1:
        raise ValueError(f"need shards >= 1 and batch_size >= 1, got {shards}, {bs}")
    srt = np.sort(np.asarray(lengths, dtype=np.int64), kind="stable")
    starts = np.arange(0, n, bs)
    ends = np.minimum(starts + bs, n)
    cost = np.cumsum((ends - starts) * (srt[ends - 1] if n else 0))
    total = float(cost[-1]) if n else 0.0
    cuts = [0]  # batches before each shard
    for i in range(1, shards):
        c = int(np.searchsorted(cost, total * i / shards))  # cost[c] >= target
        if c < len(cost):  # take c + 1 batches or c, whichever ends nearer the target
            below = float(cost[c - 1]) if c > 0 else 0.0
            c = c + 1 if float(cost[c]) - total * i / shards < total * i / shards - below else c
        cuts.append(min(max(c, cuts[-1]), len(starts)))
    cuts.append(len(starts))
    rows = [int(x) for x in starts] + [n]
    return [(rows[a], rows[b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _prepare(model_dir, pool, cfg: dict | None, threads: int | None):
    """Merged cfg, pool records, resolved model path (offline, threads set)."""
    import torch

    from clusterft.modeling.hf import resolve_model
    from clusterft.pipeline.io import set_offline_env
    from clusterft.pools.poolfile import load_pool

    set_offline_env()
    cfg = merge_cfg(cfg)
    if threads and not cfg["num_threads"]:  # as run_score: Snakemake's thread count
        torch.set_num_threads(int(threads))
    records = load_pool(pool)
    if int(cfg["shards"]) > len(records):
        raise InputError(f"score.shards = {cfg['shards']} is larger than the pool "
                         f"({len(records)} examples)", path=str(pool), field="score.shards")
    return cfg, records, resolve_model(str(model_dir), field="score model")


def _fingerprint(cfg: dict, seed: int, model_path: str, pool: Any) -> str:
    return score_fingerprint(cfg, seed, provenance.digest(model_path), provenance.digest(pool))


@contextlib.contextmanager
def _num_threads(cfg: dict):
    """score.num_threads torch threads while scoring (as compute_features_info)."""
    import torch

    before = torch.get_num_threads()
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _LoraModel:
    """The base model with the score run's LoRA adapters (same seed, same modules), the
    attention kernel and requires_grad flags as ``clusterft.stages.score`` sets them."""

    def __init__(self, path: str, cfg: dict, seed: int) -> None:
        from clusterft.modeling import lora
        from clusterft.modeling.distributed import resolve_device
        from clusterft.modeling.hf import load_causal_lm

        self.device = resolve_device(cfg["device"], "score.device")
        model = load_causal_lm(path)
        model.to(self.device)
        if cfg["attn_implementation"] and cfg["attn_implementation"] != getattr(
                model.config, "_attn_implementation", None):
            model.set_attn_implementation(cfg["attn_implementation"])
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = lora.add_lora(model, cfg["lora"], "score.lora", seed)
        self.proj = make_projector(self.model, cfg, seed, self.device)


# --------------------------------------------------------------------------- warm-up

def save_warmup(path: str | os.PathLike, info: dict, lengths: Sequence[int],
                fingerprint: str, adam: bool) -> None:
    """``info`` (``warmup_lora(..., snapshots=True)``'s) as one safetensors file."""
    from safetensors.torch import save_file
    import torch

    from clusterft.pipeline.io import atomic_path

    tensors = {"lengths": torch.tensor(list(lengths), dtype=torch.int64)}
    for k, c in enumerate(info["checkpoints"]):
        for name, t in c["lora"].items():
            tensors[f"checkpoint.{k}.{name}"] = t.contiguous()
        if adam:
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"checkpoint.{k}.{key}"] = c[key].contiguous()
    for step, lora_state in info["loss_snapshots"].items():
        for name, t in lora_state.items():
            tensors[f"loss_step.{int(step)}.{name}"] = t.contiguous()
    meta = {k: info[k] for k in ("warmup_examples", "warmup_steps", "warmup_losses",
                                 "warmup_lrs")}
    meta["checkpoints"] = [{"step": int(c["step"]), "lr_mean": float(c["lr_mean"])}
                           for c in info["checkpoints"]]
    meta["loss_steps"] = sorted(int(s) for s in info["loss_snapshots"])
    with atomic_path(path) as tmp:
        # one metadata key: safetensors writes several in no fixed order (a Rust HashMap),
        # and the file's bytes (its digest: the shards' lineage) should not vary
        save_file(tensors, str(tmp), metadata={"clusterft": json.dumps(
            {"format": WARMUP_FORMAT, "fingerprint": fingerprint, "info": meta})})


def load_warmup(path: str | os.PathLike) -> dict:
    """A warm-up file as {fingerprint, info, lengths, checkpoints: [{step, lr_mean, lora,
    exp_avg, exp_avg_sq}], loss_snapshots: {step: lora}} (tensors on the CPU)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("clusterft", "{}"))
            if meta.get("format") != WARMUP_FORMAT:
                raise InputError(f"not a score warm-up file (format {meta.get('format')!r}, "
                                 f"expected {WARMUP_FORMAT})", path=str(path))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except InputError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise InputError(f"not a readable score warm-up file ({e})", path=str(path)) from e
    info = meta["info"]
    checkpoints = [{**c, "lora": {}, "exp_avg": None, "exp_avg_sq": None}
                   for c in info["checkpoints"]]
    snaps: dict[int, dict] = {int(s): {} for s in info["loss_steps"]}
    for key, t in tensors.items():
        kind, _, rest = key.partition(".")
        if kind == "lengths":
            continue
        idx, _, name = rest.partition(".")
        if kind == "checkpoint":
            c = checkpoints[int(idx)]
            if name in ("exp_avg", "exp_avg_sq"):
                c[name] = t
            else:
                c["lora"][name] = t
        else:
            snaps[int(idx)][name] = t
    return {"fingerprint": meta["fingerprint"], "info": info, "checkpoints": checkpoints,
            "loss_snapshots": snaps, "lengths": tensors["lengths"].numpy()}


def run_score_warmup(model_dir: str | os.PathLike, pool: str | os.PathLike, cfg: dict | None,
                     out_warmup: str | os.PathLike, seed: int = 0, threads: int | None = None,
                     length_policy: dict | None = None) -> dict:
    """Rule ``score_warmup``: train the warm-up once and write ``out_warmup`` (section
    "sharded scoring", step 1) and its provenance sidecar (lineage ``score_warmup``: the
    shards and the merge check they use this one). Resumes from ``<out_warmup>.ckpt/``."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.tokenize import LENGTH_POLICY, check_length_policy

    t0 = time.perf_counter()
    cfg, records, path = _prepare(model_dir, pool, cfg, threads)
    checked = provenance.check_inputs({"model": path, "pool": pool}, "score_warmup")
    tok = load_tokenizer(path)
    if length_policy is not None:
        policy = {**LENGTH_POLICY, **length_policy}
        check_length_policy(tok, records, int(policy["max_length"]),
                            str(policy["truncation"]), str(pool))
    if tok.pad_token_id is None:
        raise InputError("tokenizer has no pad token", field="model")
    encoded, n_trunc = _encode_all(tok, records, cfg)
    fp = _fingerprint(cfg, seed, path, pool)
    ckpt_dir = Path(str(out_warmup) + ".ckpt")
    ckpt = Checkpoints(ckpt_dir, fp) if int(cfg["checkpoint_every"]) > 0 else None
    with _num_threads(cfg):
        lm = _LoraModel(path, cfg, seed)
        info = warmup_lora(lm.model, encoded, cfg, seed, tok.pad_token_id, ckpt=ckpt,
                           snapshots=True)
    if cfg["gradient_type"] == "adam" and info["exp_avg"] is None:
        raise InputError("gradient_type 'adam' needs a warm-up (warmup_steps > 0)",
                         field="score.gradient_type")
    save_warmup(out_warmup, info, [e["length"] for e in encoded], fp,
                cfg["gradient_type"] == "adam")
    recorded = {k: v for k, v in cfg.items() if k != "shards"}  # shared by every count
    provenance.write({"warmup": out_warmup}, "score_warmup", checked,
                     inherit=("pool", "model"), own={"score_warmup": "warmup"},
                     config=recorded, seed=seed)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    out = {"n": len(records), "truncated": n_trunc,
           "checkpoint_steps": [int(c["step"]) for c in info["checkpoints"]],
           "warmup_steps": info["warmup_steps"], "warmup_resumed": info["warmup_resumed"],
           "seconds": round(time.perf_counter() - t0, 2)}
    log.info("score warm-up: %d steps on %d examples in %.1fs", info["warmup_steps"],
             info["warmup_examples"], out["seconds"])
    return out


# --------------------------------------------------------------------------- shards

def _checked_warmup(warmup: Any, cfg: dict, seed: int, path: str, pool: Any) -> dict:
    """The warm-up file, refused unless it was made with this config, seed, model, pool."""
    w = load_warmup(warmup)
    if w["fingerprint"] != _fingerprint(cfg, seed, path, pool):
        raise InputError("this warm-up was made with another score config, seed, model or "
                         f"pool than {pool} with seed {seed}; rerun score_warmup "
                         f"({provenance.describe(warmup, provenance.read(warmup))})",
                         path=str(warmup), field="score")
    return w


def _shard_pass(path: str, cfg: dict, seed: int, w: dict, encoded: Sequence[dict],
                rows: np.ndarray, records: Sequence[dict], enc_targets: Sequence[dict] | None,
                ckpt: Checkpoints | None, pad_id: int, what: str) -> tuple[dict, dict | None]:
    """The arrays of one shard: loss trajectories of its rows (the warm-up's snapshots,
    ``pool_losses``' batches), their projected gradients and norms at every checkpoint
    (the one-job run's batches: ``encoded`` is in length-sorted order and starts at a batch
    boundary) and, with ``enc_targets``, the targets' (after the pool's, as run_score).
    Returns (arrays, where the gradient pass resumed or None)."""
    from clusterft.pipeline.pace import Pace
    from clusterft.modeling.tokenize import collate

    checkpoints = w["checkpoints"]
    bs, n_ckpt, n, dim = int(cfg["batch_size"]), len(checkpoints), len(rows), int(cfg["dim"])
    at = loss_steps(int(w["info"]["warmup_steps"]), int(cfg["loss_points"]))
    traj = np.full((n, len(at)), np.nan, dtype=np.float32)
    projected = np.zeros((n_ckpt, n, dim), dtype=np.float32)
    norms = np.zeros((n_ckpt, n), dtype=np.float32)
    if not n and enc_targets is None:
        return {"projected": projected, "norms": norms, "trajectories": traj}, None
    lm = _LoraModel(path, cfg, seed)
    pmodel = lm.model
    k0, start, resumed = 0, 0, None
    done = ckpt.load("gradients.pt") if ckpt is not None else None
    if done is not None:
        k0, start = done["checkpoint"], done["next"]
        projected, norms, traj = done["projected"], done["norms"], done["trajectories"]
        resumed = {"checkpoint": k0, "row": start}
    pmodel.eval()
    if n and done is None:
        for step in w["info"]["loss_steps"]:
            _set_lora(pmodel, w["loss_snapshots"][step])
            losses = pool_losses(pmodel, encoded, bs, pad_id, use_sparse_logits(pmodel, cfg))
            traj[:, [j for j, s in enumerate(at) if s == step]] = losses[:, None]
    every = int(cfg["checkpoint_every"]) * bs if ckpt is not None else 0
    left = (n_ckpt - k0) * -(-n // bs) - start // bs
    with Pace(left, what, unit="batch", units="batches", disable=left <= 1) as pace:
        for k in range(k0, n_ckpt if n else 0):
            _set_lora(pmodel, checkpoints[k]["lora"])
            moments = (tuple(checkpoints[k][key].to(lm.device)
                             for key in ("exp_avg", "exp_avg_sq"))
                       if cfg["gradient_type"] == "adam" else None)
            for b in range(start if k == k0 else 0, n, bs):
                batch = {key: v.to(lm.device) for key, v in
                         collate(encoded[b:b + bs], pad_id).items()}
                r, nrm = project_batch(pmodel, batch, cfg, lm.proj, moments)
                norms[k, b:b + bs] = nrm.cpu().numpy()
                projected[k, b:b + bs] = r.cpu().numpy()
                bad = np.flatnonzero(~np.isfinite(projected[k, b:b + bs]).all(1))
                refuse_rows(rows[b + bad], "non-finite gradients",
                            "the warm-up diverged or the model overflows", records, cfg)
                pace.update()
                nxt = (k, b + bs) if b + bs < n else (k + 1, 0)
                if every and ((b + bs) % every == 0 or b + bs >= n) and nxt[0] < n_ckpt:
                    ckpt.save("gradients.pt", {"checkpoint": nxt[0], "next": nxt[1],
                                               "projected": projected, "norms": norms,
                                               "trajectories": traj})
    out = {"projected": projected, "norms": norms, "trajectories": traj}
    if enc_targets is not None:
        out["target_projected"], out["target_norms"] = _target_pass(
            pmodel, enc_targets, checkpoints, lm.proj, cfg, pad_id, lm.device)
    pmodel.unload()
    return out, resumed


def run_score_shard(model_dir: str | os.PathLike, pool: str | os.PathLike,
                    warmup: str | os.PathLike, cfg: dict | None, shard: int,
                    out_shard: str | os.PathLike, seed: int = 0, threads: int | None = None,
                    targets: Any = None) -> dict:
    """Rule ``score_shard``: shard ``shard`` of ``score.shards`` (section "sharded
    scoring", step 2) into ``out_shard`` (.npz) and its sidecar. ``targets`` as for
    ``run_score`` (used by shard 0 only). Resumes from ``<out_shard>.ckpt/``."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.pipeline.io import atomic_path
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
    w = _checked_warmup(warmup, cfg, seed, path, pool)
    bs = int(cfg["batch_size"])
    order = np.argsort(w["lengths"], kind="stable")
    lo, hi = shard_bounds(w["lengths"], bs, shards)[int(shard)]
    rows = order[lo:hi]
    tok = load_tokenizer(path)
    pad_id = tok.pad_token_id
    encoded, _ = _encode_all(tok, [records[i] for i in rows], cfg)
    if [e["length"] for e in encoded] != w["lengths"][rows].tolist():
        raise InputError("the pool's token lengths differ from the warm-up's: another "
                         "tokenizer or max_length", path=str(warmup), field="score.max_length")
    enc_targets = _encode_all(tok, t_records, cfg, "targets")[0] if with_targets else None
    n = len(rows)
    fp = hashlib.sha1(json.dumps({"warmup": provenance.digest(warmup), "shard": int(shard),
                                  "shards": shards, "cfg": w["fingerprint"]}
                                 ).encode()).hexdigest()
    ckpt_dir = Path(str(out_shard) + ".ckpt")
    ckpt = Checkpoints(ckpt_dir, fp) if int(cfg["checkpoint_every"]) > 0 else None
    with _num_threads(cfg):
        blob, resumed = _shard_pass(path, cfg, seed, w, encoded, rows, records, enc_targets,
                                    ckpt, pad_id, f"score shard {shard}")
    blob.update({"format": np.array(SHARD_FORMAT), "shard": np.array(int(shard)),
                 "shards": np.array(shards), "bounds": np.array([lo, hi]),
                 "rows": rows.astype(np.int64)})
    if with_targets:
        blob.update({"target_ids": np.array([str(r["id"]) for r in t_records], dtype=str),
                     "target_tasks": np.array([str(t) for t in t_tasks], dtype=str)})
    with atomic_path(out_shard) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to the name
            np.savez(f, **blob)
    provenance.write({"shard": out_shard}, "score_shard", checked,
                     inherit=("warmup", "items"), config=cfg, seed=seed)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    secs = round(time.perf_counter() - t0, 2)
    log.info("score shard %d of %d: rows %d..%d of the length-sorted pool (%d examples%s) "
             "in %.1fs", shard, shards, lo, hi, n,
             f", {len(t_records)} targets" if with_targets else "", secs)
    return {"shard": int(shard), "shards": shards, "rows": [int(lo), int(hi)], "n": n,
            "n_targets": len(t_records) if with_targets else 0,
            "gradients_resumed_at": resumed, "seconds": secs}


# --------------------------------------------------------------------------- merge

def _load_shard(path: str | os.PathLike) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            blob = {k: z[k] for k in z.files}
    except Exception as e:
        raise InputError(f"not a readable score shard ({e})", path=str(path)) from e
    if str(blob.get("format")) != SHARD_FORMAT:
        raise InputError(f"not a score shard (format {blob.get('format')!s}, expected "
                         f"{SHARD_FORMAT})", path=str(path))
    return blob


def run_score_merge(model_dir: str | os.PathLike, pool: str | os.PathLike,
                    warmup: str | os.PathLike, shard_paths: Sequence[str | os.PathLike],
                    cfg: dict | None, out_features: str | os.PathLike,
                    out_scores: str | os.PathLike, seed: int = 0,
                    out_trajectories: str | os.PathLike | None = None, targets: Any = None,
                    out_targets: str | os.PathLike | None = None,
                    out_target_ids: str | os.PathLike | None = None) -> dict:
    """Rule ``score`` with ``score.shards`` > 1: the shards (section "sharded scoring",
    step 3) into ``run_score``'s files, with the same bytes. Refuses shards of another
    warm-up (provenance), of another shard count, or that do not cover the pool exactly
    once."""
    import pandas as pd

    from clusterft.pipeline.io import save_npy, set_offline_env, write_parquet
    from clusterft.modeling.hf import resolve_model
    from clusterft.pools.poolfile import load_pool
    from clusterft.tasks.targets import check_outputs, resolve_targets, write_outputs

    set_offline_env()
    cfg = merge_cfg(cfg)
    check_outputs(targets, out_targets, out_target_ids)
    records = load_pool(pool)
    _, _, t_dirs = resolve_targets(targets) if targets is not None else (None, [], [])
    path = resolve_model(str(model_dir), field="score model")
    shards = int(cfg["shards"])
    if len(shard_paths) != shards:
        raise InputError(f"{len(shard_paths)} shard files for score.shards = {shards}",
                         field="score.shards")
    checked = provenance.check_inputs({"model": path, "pool": pool, "items": t_dirs or None,
                                       "warmup": warmup, "shards": list(shard_paths)},
                                      "score")
    w = _checked_warmup(warmup, cfg, seed, path, pool)
    n = len(records)
    blobs = [_load_shard(p) for p in shard_paths]
    bounds = shard_bounds(w["lengths"], int(cfg["batch_size"]), shards)
    order = np.argsort(w["lengths"], kind="stable")
    for i, (p, b) in enumerate(zip(shard_paths, blobs)):
        if int(b["shard"]) != i or int(b["shards"]) != shards or \
                tuple(int(x) for x in b["bounds"]) != bounds[i] or \
                not np.array_equal(b["rows"], order[bounds[i][0]:bounds[i][1]]):
            raise InputError(f"expected shard {i} of {shards} (rows {bounds[i][0]}..."
                             f"{bounds[i][1]} of the length-sorted pool), got shard "
                             f"{int(b['shard'])} of {int(b['shards'])} (rows "
                             f"{b['bounds'].tolist()})", path=str(p), field="score.shards")
    rows = np.concatenate([b["rows"] for b in blobs])
    if len(rows) != n or not np.array_equal(np.sort(rows), np.arange(n)):
        raise InputError(f"the shards hold {len(rows)} rows, not each of the pool's {n} once",
                         path=str(shard_paths[0]), field="score.shards")
    checkpoints = w["info"]["checkpoints"]
    dim = int(cfg["dim"])
    projected = np.zeros((len(checkpoints), n, dim), dtype=np.float32)
    norms = np.zeros((len(checkpoints), n), dtype=np.float32)
    trajectories = None
    for b in blobs:
        projected[:, b["rows"]] = b["projected"]
        norms[:, b["rows"]] = b["norms"]
        if trajectories is None:
            trajectories = np.full((n, b["trajectories"].shape[1]), np.nan, dtype=np.float32)
        trajectories[b["rows"]] = b["trajectories"]
    features, scores, weights = pool_features(projected, norms, checkpoints, records, cfg)
    save_npy(out_features, features)
    write_parquet(out_scores, pd.DataFrame({"id": [r["id"] for r in records],
                                            "score": scores.astype(np.float64),
                                            "grad_norm": norms[-1].astype(np.float64)}))
    outputs = {"features": out_features, "scores": out_scores}
    if out_trajectories is not None:
        save_npy(out_trajectories, trajectories)
        outputs["trajectories"] = out_trajectories
    n_targets = 0
    if out_targets is not None:
        tb = blobs[TARGET_SHARD]
        t_rows, t_recs, t_tasks = None, None, []
        if targets is not None:
            if "target_projected" not in tb:
                raise InputError("targets were asked for but shard 0 has none: it was "
                                 "computed without them", path=str(shard_paths[TARGET_SHARD]),
                                 field="targets")
            t_proj, t_norms = tb["target_projected"], tb["target_norms"]
            t_recs = [{"id": str(i)} for i in tb["target_ids"]]
            t_tasks = [str(t) for t in tb["target_tasks"]]
            t_rows = target_features(t_proj, t_norms, weights, t_recs, cfg)
            n_targets = len(t_recs)
        outputs.update(write_outputs(out_targets, out_target_ids, t_rows, t_recs, t_tasks,
                                     features.shape[1]))
    provenance.write(outputs, "score", checked, inherit=("pool", "model", "items"),
                     run_key="score_run", config=cfg, seed=seed)
    log.info("merged %d shards: %d examples, %d targets", shards, n, n_targets)
    return {"n": n, "shards": shards, "n_targets": n_targets, "dim": int(features.shape[1]),
            "checkpoint_steps": [int(c["step"]) for c in checkpoints],
            "checkpoint_weights": weights, "warmup_steps": w["info"]["warmup_steps"],
            "warmup_losses": w["info"]["warmup_losses"]}
