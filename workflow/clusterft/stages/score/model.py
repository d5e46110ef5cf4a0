"""The scoring model, set up once for every score job: the base model on the device, with
the configured attention kernel, frozen, plus LoRA adapters initialised from the run's seed
and the projection of their gradients. The warm-up, the gradient pass of each shard and the
one-job run all go through :func:`scoring_model`, so the adapters they train, load and
differentiate are the same modules in the same order; on exit the model is as it was
(adapters removed, modes, flags and kernel restored: ``compute_features`` hands back the
caller's model unchanged).

Precision (``score.precision``, :func:`load_base`): with bf16 on a CUDA GPU the frozen base
is loaded in bfloat16 straight onto the device (``precision.base_dtype``, as train's LoRA
runs), peft keeps the adapters in float32, and the forward passes run under bfloat16
autocast (``gradients.forward_autocast``); everywhere else the base is float32 as before."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from clusterft.modeling import lora
from clusterft.modeling.distributed import resolve_device
from clusterft.modeling.precision import resolve_precision
from clusterft.stages.score.projection import make_projector


@dataclass
class Scoring:
    """What :func:`scoring_model` yields: the model with its adapters (peft), the projector
    of their gradients, the device both live on and the resolved precision (bf16 | fp32)."""

    model: Any
    proj: Any
    device: Any
    precision: str = "fp32"


def load_base(path: Any, cfg: dict):
    """The frozen base of a score job from its folder ``path``, for ``cfg`` (merged): on a
    CUDA device in bf16 (``score.precision`` bf16, or auto on a GPU with bf16) in bfloat16,
    placed on the device while it loads (no float32 host copy of a 13B model first); on a
    CPU in float32, exactly as before (CPU bf16 is autocast over float32 weights)."""
    import torch

    from clusterft.modeling.hf import load_causal_lm
    from clusterft.modeling.precision import base_dtype

    device = torch.device(resolve_device(cfg["device"], "score.device"))
    if device.type != "cuda":
        return load_causal_lm(path)
    precision = resolve_precision(cfg["precision"], device, "score.precision")
    return load_causal_lm(path, dtype=base_dtype(precision, device, "lora"), device=device)


@contextlib.contextmanager
def scoring_model(model, cfg: dict, seed: int) -> Iterator[Scoring]:
    """``model`` (a base causal LM) set up for scoring with ``cfg`` (merged), restored on exit
    (it stays on the device). The projector is made before any work, so a ``dim`` that
    kronecker cannot split fails at once (its matrices come from numpy streams of their
    own: no torch RNG is drawn). The precision is resolved here once (an explicit bf16 on a
    CPU that emulates it warns, in the job's log)."""
    device = resolve_device(cfg["device"], "score.device")
    precision = resolve_precision(cfg["precision"], device, "score.precision")
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
        yield Scoring(pmodel, make_projector(pmodel, cfg, seed, device), device, precision)
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
