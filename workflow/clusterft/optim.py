"""The one optimiser and learning-rate schedule that every training loop here uses
(pretraining, the scoring warm-up, fine-tuning): AdamW with linear warm-up, then a decay."""

from __future__ import annotations

import math
from typing import Callable, Iterable

from .errors import InputError

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
