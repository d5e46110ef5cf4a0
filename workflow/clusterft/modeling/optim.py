"""The one optimiser and learning-rate schedule that every training loop here uses
(pretraining, the scoring warm-up, fine-tuning): AdamW with linear warm-up, then a decay."""

from __future__ import annotations

import math
from typing import Callable, Iterable

from clusterft.pipeline.errors import InputError

SCHEDULES = ("cosine", "linear", "constant")


def lr_lambda(schedule: str, warmup: int, total: int, floor: float = 0.1,
              field: str = "schedule") -> Callable[[int], float]:
    """Multiplier of the peak lr at a step: linear warm-up over ``warmup`` steps, then a
    cosine or linear decay to ``floor`` x the peak at step ``total`` (or constant)."""
    if schedule not in SCHEDULES:
        raise InputError(f"unknown schedule '{schedule}' ({'|'.join(SCHEDULES)})", field=field)

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        if schedule == "linear" and floor == 0:
            # To zero as LESS writes it (steps left / decay steps): the same value as the
            # branch below up to rounding, kept so that earlier features reproduce bit for bit.
            return max(0.0, (total - step) / max(1, total - warmup))
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def adamw(params: Iterable, *, lr: float, weight_decay: float, schedule: str, warmup: int,
          total: int, floor: float = 0.1, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, field: str = "schedule"):
    """AdamW over ``params`` and its LambdaLR schedule (:func:`lr_lambda`): (opt, sched)."""
    import torch

    opt = torch.optim.AdamW(list(params), lr=float(lr), weight_decay=float(weight_decay),
                            betas=betas, eps=eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule, int(warmup), int(total),
                                                             floor, field))
    return opt, sched


class DivergedError(InputError):
    """A loss or gradient that is no longer finite: the run diverged (a config to change)."""


# What else to try when a loop with gradient clipping and a precision setting diverges.
CLIP_OR_FP32 = ", keep gradient clipping on (grad_clip > 0) or use fp32 where bf16 was set"


def check_finite(loss: float | None, grad_norm: float | None, *, step: int, total: int,
                 run: str, lr_field: str, lr: float, hint: str = "",
                 checkpoint: str | None = None) -> None:
    """Stop a training loop whose loss or gradient norm is NaN or infinite, before the
    optimiser step writes it into the weights; the error names the step, the run, the
    learning-rate key ``lr_field`` to lower (``train.lr``, ``models.small.pretrain.lr``,
    ``score.warmup_lr``), ``hint`` (what else to try) and the checkpoint that is kept."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if value is not None and not math.isfinite(float(value))]
    if not bad:
        return
    kept = (f"; the last checkpoint ({checkpoint}) is kept and a rerun with a lower lr "
            "starts over from scratch, as its fingerprint differs" if checkpoint else "")
    raise DivergedError(f"{run}: {' and '.join(bad)} at step {step} of {total}: training "
                        f"diverged. Lower {lr_field} (now {lr:g}){hint}{kept}", field=lr_field)
