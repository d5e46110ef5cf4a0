"""The scoring model, set up once for every score job: the base model on the device, with
the configured attention kernel, frozen, plus LoRA adapters initialised from the run's seed
and the projection of their gradients. The warm-up, the gradient pass of each shard and the
one-job run all go through :func:`scoring_model`, so the adapters they train, load and
differentiate are the same modules in the same order; on exit the model is as it was
(adapters removed, modes, flags and kernel restored: ``compute_features`` hands back the
caller's model unchanged)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from clusterft.modeling import lora
from clusterft.modeling.distributed import resolve_device
from clusterft.stages.score.projection import make_projector


@dataclass
class Scoring:
    """What :func:`scoring_model` yields: the model with its adapters (peft), the projector
    of their gradients and the device both live on."""

    model: Any
    proj: Any
    device: Any


@contextlib.contextmanager
def scoring_model(model, cfg: dict, seed: int) -> Iterator[Scoring]:
    """``model`` (a base causal LM) set up for scoring with ``cfg`` (merged), restored on exit
    (it stays on the device). The projector is made before any work, so a ``dim`` that
    kronecker cannot split fails at once (its matrices come from numpy streams of their
    own: no torch RNG is drawn)."""
    device = resolve_device(cfg["device"], "score.device")
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
        yield Scoring(pmodel, make_projector(pmodel, cfg, seed, device), device)
    finally:
        if pmodel is not None:
            pmodel.unload()  # remove the adapters: the caller's model is left as it was
        model.train(base_training)
        for p, flag in zip(model.parameters(), base_requires_grad):
            p.requires_grad_(flag)
        if base_attn and getattr(model.config, "_attn_implementation", None) != base_attn:
            model.set_attn_implementation(base_attn)


@contextlib.contextmanager
def num_threads(cfg: dict) -> Iterator[None]:
    """score.num_threads torch threads while scoring (0: leave them), restored on exit."""
    import torch

    before = torch.get_num_threads()
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    try:
        yield
    finally:
        torch.set_num_threads(before)
