"""A plain supervised fine-tune for a fixed number of steps, in one process: what a stage
other than `train` needs to fine-tune a model on its own generated examples (the base
model's practice, clusterft.stages.models.practice), without the train stage's sampler,
distribution, checkpoints and metrics (stages talk through files, not imports).

The recipe is the train stage's defaults for one rank: AdamW without weight decay, a linear
schedule with 5% warm-up (decay to 10% of lr), gradient clip 1.0, the mean loss over the
step's answer tokens, fp32; each epoch a seeded shuffle of the examples, cut into batches.
"""

from __future__ import annotations

import numpy as np


def fine_tune_steps(model, tokenizer, examples: list[dict], steps: int, batch_size: int,
                    lr: float, seed: int = 0, warmup_ratio: float = 0.05,
                    grad_clip: float = 1.0, run: str = "fine-tune",
                    lr_field: str = "lr") -> dict:
    """Train ``model`` in place for ``steps`` optimiser steps on encoded ``examples``
    (clusterft.modeling.tokenize.encode_records); returns the first and final loss (mean of
    the first / last 50 steps) and the steps. A loss or gradient that stops being finite
    raises DivergedError naming ``run``."""
    import torch

    from clusterft.modeling.microbatch import CausalLMLoss, backward_step
    from clusterft.modeling.optim import CLIP_OR_FP32, adamw, check_finite
    from clusterft.modeling.tokenize import Collator
    from clusterft.pipeline.pace import Pace

    if steps < 1 or len(examples) < batch_size:
        raise ValueError(f"{run}: needs steps >= 1 and at least one batch of {batch_size} "
                         f"examples, got {steps} steps and {len(examples)} examples")
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 17])
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = adamw(params, lr=lr, weight_decay=0.0, schedule="linear",
                       warmup=round(warmup_ratio * steps), total=steps)
    loss_fn = CausalLMLoss(model)
    collate = Collator(tokenizer.pad_token_id)
    losses: list[float] = []
    order: list[int] = []
    model.train()
    pace = Pace(steps, run, mininterval=1.0)
    for step in range(steps):
        if len(order) < batch_size:  # a new epoch: a fresh shuffle (the rest is dropped)
            order = rng.permutation(len(examples)).tolist()
        batch, order = order[:batch_size], order[batch_size:]
        loss, _, _ = backward_step(loss_fn, [examples[i] for i in batch], collate, 256.0,
                                   device)
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        check_finite(loss, norm, step=step + 1, total=steps, run=run, lr_field=lr_field,
                     lr=lr, hint=CLIP_OR_FP32)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        pace.update()
    pace.close()
    loss_fn.release()
    model.eval()
    k = min(50, len(losses))
    return {"steps": steps, "first_loss": float(np.mean(losses[:k])),
            "final_loss": float(np.mean(losses[-k:]))}
