"""Hugging Face model and tokenizer folders: resolve, load offline, save atomically.

Every stage that reads or writes a model goes through here, so one place decides what a
usable model folder is and how a hub id is allowed in.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path, set_offline_env


def resolve_model(spec: str, allow_downloads: bool = False, field: str = "model",
                  need_config: bool = True) -> str:
    """Return a local model dir for ``spec``, or the hub id itself when downloads are allowed.

    Raises InputError naming ``field`` if ``spec`` is neither an existing dir nor usable.
    """
    if not spec:
        raise InputError("no model given", field=field)
    p = Path(spec).expanduser()
    if p.exists():
        if (p / NOT_KEPT).is_file():
            raise InputError(f"'{spec}' is the folder of a run that was only timed: it kept no "
                             f"model ({NOT_KEPT}; train.keep_model false, which the workflow "
                             "sets for the time-only runs that nothing evaluates)",
                             path=str(p), field=field)
        if need_config and not (p / "config.json").exists():
            raise InputError(f"'{spec}' exists but holds no config.json (not an HF model dir)",
                             path=str(p), field=field)
        if need_config:
            check_weights(p, field)
        return str(p)
    if allow_downloads and re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", spec):
        return spec
    raise InputError(f"model '{spec}' is not a local directory, and hub downloads are off "
                     "(set allow_downloads: true to fetch hub ids, or point it at a local model dir)",
                     field=field)


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.gguf")
# The one file in the model folder of a run that keeps no model (train.keep_model: false).
NOT_KEPT = "NOT_KEPT.json"


def check_weights(model_dir: str | os.PathLike, field: str = "model") -> None:
    """Refuse a model folder that has a config.json but no weight files (a copy that
    stopped halfway, or only the config of a model), before anything loads."""
    p = Path(model_dir)
    if p.is_dir() and not any(any(p.glob(pat)) for pat in WEIGHT_PATTERNS):
        raise InputError(f"'{p}' holds config.json but no weights ({', '.join(WEIGHT_PATTERNS)}):"
                         " copy the whole model folder, or rerun the rule that writes it",
                         path=str(p), field=field)


def load_tokenizer(path: str | os.PathLike):
    """Load a saved tokenizer dir offline and check its special tokens.

    A tokenizer without a pad token (Llama-2's, for one) gets its eos as pad: every collator
    here masks padding by position (labels -100, attention 0 past each example's length),
    never by token id, so an eos that is also the pad still trains where it ends a response.
    Adding a new <pad> token instead would grow the embedding matrix of a frozen base.
    Padding is on the right for training, scoring and embedding; lm-eval pads on the left
    for generation on its own (its `hf` model), whatever this side says.
    """
    set_offline_env()
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise InputError("tokenizer directory does not exist", path=str(p))
    tok = AutoTokenizer.from_pretrained(str(p))
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(tok, name) is None:
            raise InputError(f"tokenizer has no {name.removesuffix('_id')}", path=str(p))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def load_causal_lm(path: str | os.PathLike, dtype=None, device=None):
    """A causal LM from a local dir, in ``dtype`` (float32 by default, whatever its saved
    dtype: every stage here computes in float32 with bf16 only as autocast, except a frozen
    LoRA base on a GPU, `precision.base_dtype`), placed on ``device`` while it loads: a GPU
    rank never holds a float32 copy of a 13B model in host memory first."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": dtype or torch.float32}
    if device is not None and torch.device(device).type != "cpu":
        kw["device_map"] = {"": str(torch.device(device))}
    return AutoModelForCausalLM.from_pretrained(str(path), **kw)


def adapter_base(model_dir: str | os.PathLike) -> str | None:
    """The base model a peft adapter folder was trained on (its adapter_config.json's
    base_model_name_or_path, as the run gave it), or None for a plain model folder."""
    cfg = Path(model_dir) / "adapter_config.json"
    if not cfg.is_file():
        return None
    import json

    base = json.loads(cfg.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise InputError("adapter_config.json names no base_model_name_or_path: save the "
                         "adapter from a model loaded from its folder", path=str(cfg))
    return str(base)


def unwrapped(model):
    """The model inside a DDP wrapper (a peft model has a `module` of its own: kept)."""
    return model.module if hasattr(model, "module") and not hasattr(model, "peft_config") else model


def save_adapter_dir(model, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save a LoRA run as a peft adapter folder (adapter weights + config naming the base,
    and the tokenizer), atomically: megabytes where a merged 13B copy is 26-52 GB."""
    m = unwrapped(model)
    if not hasattr(m, "peft_config"):
        raise InputError("not a peft model: only LoRA runs save an adapter", field="train.finetune")
    with atomic_path(out_dir, is_dir=True) as tmp:
        m.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


def plain_model(model):
    """The plain HF model to save: DDP unwrapped, LoRA merged into the weights."""
    m = unwrapped(model)
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    m.config.use_cache = True
    return m


def saved_bytes(model, adapter: bool) -> int:
    """The bytes of the weights a save would write: the LoRA adapters' (``adapter``) or,
    else, every parameter of the plain model (LoRA merged: the base's parameters), each at
    its dtype's size; tied weights count once. The tokenizer's few MB are not counted."""
    m = unwrapped(model)
    if adapter:
        return int(sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                       if "lora_" in n))
    if hasattr(m, "get_base_model"):  # peft: the merged copy has the base's shapes and dtypes
        m = m.get_base_model()
    return int(sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                   if "lora_" not in n))


def weights_digest(model, adapter: bool) -> str:
    """sha256 over the weights a save would write (the LoRA adapters' tensors, or every
    parameter and buffer of the model), by name and dtype in name order: a run that keeps
    no model still shows whether two trainings ended at the same weights (a resumed run and
    an uninterrupted one, tests/test_workflow.py, tests/test_slurm.py)."""
    import hashlib

    import torch

    m = unwrapped(model)
    sd = {n: p for n, p in m.state_dict().items() if ("lora_" in n) == adapter or not adapter}
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_not_kept(out_dir: str | os.PathLike, info: dict) -> None:
    """A model folder that holds only ``NOT_KEPT.json`` (``info``: why, the run, the bytes a
    save would have taken), atomically: what a run that keeps no model leaves."""
    import json

    with atomic_path(out_dir, is_dir=True) as tmp:
        (Path(tmp) / NOT_KEPT).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n",
                                          encoding="utf-8")


def save_model_dir(model, tokenizer, out_dir: str | os.PathLike, extra=None) -> None:
    """Save model + tokenizer as one plain HF dir, atomically; ``extra(tmp_dir)`` may add
    files before the folder is moved into place."""
    m = plain_model(model)
    with atomic_path(out_dir, is_dir=True) as tmp:
        m.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if extra is not None:
            extra(Path(tmp))
