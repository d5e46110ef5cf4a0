"""The LoRA warm-up (LESS) and the loss passes of S2L's trajectories.

Why a warm-up: a fresh adapter has ``lora_B = 0``, so every ``lora_A`` gradient is zero and
half the features would carry nothing. As in LESS the adapters are trained with AdamW on a
seeded random ``warmup_fraction`` of the pool for ``warmup_steps`` steps (or
``warmup_epochs`` passes over that subset). With ``warmup_checkpoints: K`` (LESS: one per
warm-up epoch) the steps are split into K equal consecutive segments and the adapters (and
AdamW moments) at the end of each are kept: the gradient pass runs at every checkpoint.

Loss trajectories (S2L): every pool example's loss at ``loss_points`` evenly spaced steps,
0 (the base model) to the last. The warm-up keeps the adapters at those steps
(``loss_snapshots``) instead of measuring there, so that the pool's losses are measured by
the gradient pass of each shard over its own rows (:func:`loss_trajectories`): the same
batches, the same bytes, whether one job scores the pool or several. Measuring is no-grad
and in eval mode, so the warm-up's weights and random streams do not depend on it.

The warm-up travels between jobs as one safetensors file (:func:`save_warmup`,
:func:`load_warmup`); the one-job run keeps the same state in memory (:func:`warm_up`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Sequence

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.stages.score.gradients import (batch_loss, example_losses, forward_autocast,
                                              lora_parameters, set_lora, use_sparse_logits)


from clusterft.stages.score.resume import Checkpoints
from clusterft.stages.score.settings import ADAM_BETAS, ADAM_EPS, merge_cfg

log = logging.getLogger(__name__)

WARMUP_FORMAT = "clusterft-score-warmup/1"

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


def pool_losses(model, encoded: Sequence[dict], batch_size: int, pad_id: int,
                sparse: bool = False, precision: str | None = None) -> np.ndarray:
    """Each example's :func:`per_example_loss` under ``model`` as it is now: float32 [N] in
    the order of ``encoded``.

    no_grad forward passes over length-sorted batches in eval mode (no dropout, so no RNG
    draw; torch's CPU RNG is forked besides), and the model's train/eval mode is restored:
    measuring leaves a warm-up's weights and random streams exactly as they were.
    ``sparse``: the LM head at the label positions only (:func:`example_losses`);
    ``precision``: the forward passes' (``score.precision``, :func:`forward_autocast`).
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
                with forward_autocast(model, precision):
                    losses = example_losses(model, batch, sparse)
                out[idx] = losses.float().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def warmup_lora(model, encoded: Sequence[dict], cfg: dict, seed: int, pad_id: int, *,
                ckpt: Checkpoints | None = None) -> dict:
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
    - ``loss_snapshots``: step -> the adapters (name -> CPU tensor) at each of the
      ``loss_points`` evenly spaced steps (:func:`loss_steps`; step 0 is the base model,
      LoRA B being zero), where :func:`loss_trajectories` measures the pool's losses.

    ``ckpt``: the warm-up's state is kept in ``warmup.pt`` at every checkpoint (the
    checkpoints so far, the optimiser, schedule, data order and RNG states, the snapshots
    so far); a warm-up that was stopped resumes from the last one to the same weights, and
    a finished one is loaded instead of run (``warmup_resumed``).
    """
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
    out: dict = {"warmup_examples": int(n_sub), "warmup_steps": steps, "warmup_losses": [],
                 "warmup_lrs": [], "exp_avg": None, "exp_avg_sq": None, "checkpoints": [],
                 "loss_snapshots": {}}
    saved = ckpt.load("warmup.pt") if ckpt is not None else None
    if saved is not None and "loss_snapshots" not in saved["info"]:
        saved = None  # progress of an older one-job run (it measured losses): start over
    if saved is not None:
        out = saved["info"]
        set_lora(model, out["checkpoints"][-1]["lora"])
    out["warmup_resumed"] = saved is not None
    if saved is not None and saved["state"] is None:  # finished
        model.eval()
        return out
    keep = _Keeper(out, lora_parameters(model), checkpoint_ends(steps, n_ckpt) if steps else [0],
                   loss_steps(steps, int(cfg["loss_points"])), cfg["gradient_type"] == "adam")
    if steps == 0:
        keep.snapshot(0)
        if len(keep.at) > 1:
            log.warning("score.warmup_steps is 0: every one of the %d loss-trajectory points "
                        "is the base model's loss", len(keep.at))
        keep.checkpoint(0)
        if ckpt is not None:
            ckpt.save("warmup.pt", {"info": out, "state": None})
        return out
    _train(model, encoded, cfg, seed, pad_id, rng, subset, keep, ckpt,
           saved["state"] if saved is not None else None)
    model.eval()
    return out


class _Keeper:
    """What the warm-up keeps along the way in its metrics ``out``: the adapters at the
    loss-trajectory steps ``at`` and, at the checkpoint steps ``ends``, the adapters, the
    segment's mean learning rate and (``adam``) the AdamW moments."""

    def __init__(self, out: dict, params: list, ends: list[int], at: list[int],
                 adam: bool) -> None:
        self.out, self.params, self.ends, self.at, self.adam = out, params, ends, at, adam

    def _lora(self) -> dict:
        return {name: p.detach().cpu().clone() for name, p in self.params}

    def snapshot(self, step: int) -> None:
        if step in self.at:
            self.out["loss_snapshots"][step] = self._lora()

    def checkpoint(self, step: int, opt=None) -> None:
        import torch

        out = self.out
        first = self.ends[len(out["checkpoints"]) - 1] if out["checkpoints"] else 0
        lrs = out["warmup_lrs"][first:step]
        moments = {key: None for key in ("exp_avg", "exp_avg_sq")}
        if self.adam and opt is not None:
            st = [opt.state[p] for _, p in self.params]
            moments = {key: torch.cat([s[key].reshape(-1) for s in st]).detach().cpu().clone()
                       for key in moments}
        out["checkpoints"].append({"step": step, "lr_mean": float(np.mean(lrs)) if lrs else 0.0,
                                   "lora": self._lora(), **moments})
        out.update(moments)


def _train(model, encoded: Sequence[dict], cfg: dict, seed: int, pad_id: int, rng, subset,
           keep: _Keeper, ckpt: Checkpoints | None, state: dict | None) -> None:
    """The warm-up's AdamW steps (from ``state`` when resuming), keeping snapshots and
    checkpoints (:class:`_Keeper`) and, at each checkpoint, the progress in ``ckpt``."""
    import torch

    from clusterft.modeling.optim import adamw, check_finite
    from clusterft.modeling.tokenize import collate
    from clusterft.pipeline.pace import Pace

    out, params, steps = keep.out, keep.params, int(keep.out["warmup_steps"])
    sparse = use_sparse_logits(model, cfg)
    device = params[0][1].device
    opt, sched = adamw([p for _, p in params], lr=cfg["warmup_lr"], weight_decay=0.0,
                       betas=ADAM_BETAS, eps=ADAM_EPS, schedule="linear",
                       warmup=max(1, round(0.03 * steps)), total=steps, floor=0.0)
    bs = min(int(cfg["batch_size"]), len(subset))
    order, pos, start = rng.permutation(subset), 0, 0
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
            keep.snapshot(0)
        with Pace(steps, "score warm-up", initial=start, disable=steps - start < 2) as pace:
            for step in range(start, steps):
                if pos >= len(order):  # next epoch (the last batch of one may be short)
                    order, pos = rng.permutation(subset), 0
                batch = collate([encoded[i] for i in order[pos:pos + bs]], pad_id)
                pos += bs
                batch = {k: v.to(device) for k, v in batch.items()}
                with forward_autocast(model, cfg["precision"]):  # float32 LoRA and AdamW
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
                keep.snapshot(step + 1)
                if step + 1 in keep.ends:
                    keep.checkpoint(step + 1, opt)
                    if ckpt is not None:
                        ckpt.save("warmup.pt", {"info": out, "state": None if step + 1 == steps
                                                else _state(step + 1, opt, sched, rng, order,
                                                            pos, device)})


def _state(step: int, opt, sched, rng, order, pos: int, device) -> dict:
    """What a warm-up stopped after ``step`` needs to go on (inside its forked RNG)."""
    import torch

    return {"step": step, "opt": opt.state_dict(), "sched": sched.state_dict(),
            "rng": rng.bit_generator.state, "order": order, "pos": pos,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def warm_up(scoring, encoded: Sequence[dict], cfg: dict, seed: int, pad_id: int,
            ckpt: Checkpoints | None, fingerprint: str | None) -> tuple[dict, dict]:
    """The warm-up of a score run on ``scoring`` (``clusterft.stages.score.model``):
    (its state as the gradient pass takes it, :func:`warmup_state`; the metrics of
    :func:`warmup_lora`). ``gradient_type: adam`` without warm-up steps is refused."""
    info = warmup_lora(scoring.model, encoded, cfg, seed, pad_id, ckpt=ckpt)
    if cfg["gradient_type"] == "adam" and info["exp_avg"] is None:
        raise InputError("gradient_type 'adam' needs a warm-up (warmup_steps > 0)",
                         field="score.gradient_type")
    return warmup_state(info, [e["length"] for e in encoded], fingerprint), info


def warmup_state(info: dict, lengths: Sequence[int], fingerprint: str | None) -> dict:
    """A warm-up as the gradient pass and the merge take it, the shape :func:`load_warmup`
    returns: {fingerprint, info (its numbers: steps, losses, learning rates, checkpoint
    steps and learning-rate means, loss steps), lengths (every pool example's token length),
    checkpoints [{step, lr_mean, lora, exp_avg, exp_avg_sq}], loss_snapshots {step: lora}}.
    """
    meta = {k: info[k] for k in ("warmup_examples", "warmup_steps", "warmup_losses",
                                 "warmup_lrs")}
    meta["checkpoints"] = [{"step": int(c["step"]), "lr_mean": float(c["lr_mean"])}
                           for c in info["checkpoints"]]
    meta["loss_steps"] = sorted(int(s) for s in info["loss_snapshots"])
    return {"fingerprint": fingerprint, "info": meta, "checkpoints": info["checkpoints"],
            "loss_snapshots": info["loss_snapshots"],
            "lengths": np.asarray(list(lengths), dtype=np.int64)}


def save_warmup(path: str | os.PathLike, w: dict, adam: bool) -> None:
    """A warm-up (:func:`warmup_state`) as one safetensors file."""
    from safetensors.torch import save_file
    import torch

    from clusterft.pipeline.io import atomic_path

    tensors = {"lengths": torch.tensor(w["lengths"].tolist(), dtype=torch.int64)}
    for k, c in enumerate(w["checkpoints"]):
        for name, t in c["lora"].items():
            tensors[f"checkpoint.{k}.{name}"] = t.contiguous()
        if adam:
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"checkpoint.{k}.{key}"] = c[key].contiguous()
    for step, lora_state in w["loss_snapshots"].items():
        for name, t in lora_state.items():
            tensors[f"loss_step.{int(step)}.{name}"] = t.contiguous()
    with atomic_path(path) as tmp:
        # one metadata key: safetensors writes several in no fixed order (a Rust HashMap),
        # and the file's bytes (its digest: the shards' lineage) should not vary
        save_file(tensors, str(tmp), metadata={"clusterft": json.dumps(
            {"format": WARMUP_FORMAT, "fingerprint": w["fingerprint"], "info": w["info"]})})


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


def loss_trajectories(model, w: dict, encoded: Sequence[dict], cfg: dict,
                      pad_id: int) -> np.ndarray:
    """The loss trajectories of ``encoded`` (float32 [len, loss_points]): each example's
    :func:`pool_losses` with the warm-up's adapters at every loss step (a step that repeats
    fills several columns)."""
    at = loss_steps(int(w["info"]["warmup_steps"]), int(cfg["loss_points"]))
    traj = np.full((len(encoded), len(at)), np.nan, dtype=np.float32)
    for step in w["info"]["loss_steps"]:
        set_lora(model, w["loss_snapshots"][step])
        losses = pool_losses(model, encoded, int(cfg["batch_size"]), pad_id,
                             use_sparse_logits(model, cfg), cfg["precision"])
        traj[:, [j for j, s in enumerate(at) if s == step]] = losses[:, None]
    return traj
