"""Tokenizer and small Llama base models: train, build, pretrain briefly, save, resolve.

Two sizes stand in for the paper's 7B/13B models: ``small`` (~0.5–1M parameters) and
``large`` (~2–5M). Both share one byte-level BPE tokenizer trained on the general corpus.
"""

from __future__ import annotations

import math
import os
import random
import re
import time
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np

from . import hardware
from .errors import InputError
from .io import atomic_path, set_offline_env, write_json

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]

DEFAULTS: dict = {
    # Tokenizer vocabulary size (byte-level BPE, including the 256 byte tokens and 3 specials).
    "vocab_size": 2048,
    # Model sizes standing in for 7B / 13B. Keys are LlamaConfig fields.
    "sizes": {
        # ~0.75M parameters with vocab 2048.
        "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 4,
                  "max_position_embeddings": 512},
        # ~3.2M parameters with vocab 2048.
        "large": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                  "num_attention_heads": 8, "num_key_value_heads": 8,
                  "max_position_embeddings": 512},
    },
    # Brief causal-LM pretraining on the general corpus (a model section's `pretrain`
    # overrides these per model).
    "pretrain": {
        # Optimiser steps (the time knob: about linear in wall time).
        "steps": 300,
        # Tokens per packed training block.
        "block_size": 128,
        # Blocks per optimiser step.
        "batch_size": 16,
        # Peak AdamW learning rate.
        "lr": 3.0e-3,
        # AdamW weight decay.
        "weight_decay": 0.01,
        # Linear warm-up steps before the decay.
        "warmup_steps": 20,
        # Decay after warm-up: cosine or linear (to 10% of lr).
        "schedule": "cosine",
        # Gradient-norm clip (0 disables).
        "grad_clip": 1.0,
        # Torch intra-op threads (0 = leave torch's default).
        "num_threads": 0,
        # auto | bf16 | fp32: bf16 autocasts matmuls (weights and optimiser stay float32);
        # auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU (CPUs without native bf16
        # emulate it, much slower: clusterft.models.resolve_precision). The precision used
        # goes to pretrain_metrics.json.
        "precision": "auto",
        # Fraction of blocks held out to report a validation loss (0 disables).
        "val_fraction": 0.02,
    },
    # Allow `resolve_model` to fall back to a Hugging Face hub id (needs network).
    "allow_downloads": False,
}


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike | None = None,
                    seed: int = 0):
    """Train a byte-level BPE tokenizer and return it as a ``PreTrainedTokenizerFast``.

    Special tokens: ``<s>`` (bos, id 0), ``</s>`` (eos, id 1), ``<pad>`` (pad, id 2). A
    ``TemplateProcessing`` post-processor prepends ``<s>`` when ``add_special_tokens=True``.
    If ``out_dir`` is given the tokenizer is saved there (atomically) so that
    ``AutoTokenizer.from_pretrained(out_dir)`` reloads it offline. ``seed`` fixes Python's
    RNG during training (BPE training itself is deterministic given the texts).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise InputError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)} for byte-level BPE, "
                         f"got {vocab_size}", field="vocab_size")
    random.seed(seed)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((t for t in texts if t), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                 pad_token=PAD, unk_token=None, padding_side="right",
                                 clean_up_tokenization_spaces=False)
    if out_dir is not None:
        with atomic_path(out_dir, is_dir=True) as tmp:
            hf.save_pretrained(str(tmp))
    return hf


def load_tokenizer(path: str | os.PathLike):
    """Load a saved tokenizer dir offline and check its special tokens."""
    set_offline_env()
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise InputError("tokenizer directory does not exist", path=str(p))
    tok = AutoTokenizer.from_pretrained(str(p))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tok, name) is None:
            raise InputError(f"tokenizer has no {name.removesuffix('_id')}", path=str(p))
    return tok


def read_corpus(path: str | os.PathLike) -> list[str]:
    """Read the general corpus and split it into documents on runs of 2+ blank lines."""
    p = Path(path)
    if not p.exists():
        raise InputError("corpus file does not exist", path=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"corpus is not UTF-8 ({e.reason} at byte {e.start})", path=str(p)) from e
    docs = [d.strip("\n") for d in re.split(r"\n\s*\n\s*\n", text)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError("corpus is empty", path=str(p))
    return docs


def run_tokenizer(corpus: str | os.PathLike, vocab_size: int | dict, out_dir: str | os.PathLike,
                  seed: int = 0, *, allow_downloads: bool = False) -> dict:
    """Stage `tokenizer`: train the BPE tokenizer on the corpus file and save it to out_dir.

    ``vocab_size`` is an int, or the config's ``tokenizer`` section: ``{source: build,
    vocab_size}`` trains one; ``{source: hub, hub_id}`` saves a hub tokenizer (downloads
    must be allowed); ``{source: path, path}`` copies a local tokenizer dir.
    """
    section = vocab_size if isinstance(vocab_size, dict) else {"vocab_size": vocab_size}
    source = section.get("source", "build")
    set_offline_env(allow_downloads and source == "hub")
    t0 = time.perf_counter()
    if source in ("hub", "path"):
        key = "hub_id" if source == "hub" else "path"
        spec = resolve_model(section.get(key, ""), allow_downloads, field=f"tokenizer.{key}",
                             need_config=False)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec)
        with atomic_path(out_dir, is_dir=True) as tmp:
            tok.save_pretrained(str(tmp))
        return {"vocab_size": len(tok), "source": source, "seconds": round(time.perf_counter() - t0, 2)}
    if source != "build":
        raise InputError(f"unknown source '{source}' (build|hub|path)", field="tokenizer.source")
    docs = read_corpus(corpus)
    tok = train_tokenizer(_lines(docs), int(section.get("vocab_size", DEFAULTS["vocab_size"])),
                          out_dir, seed)
    return {"vocab_size": len(tok), "documents": len(docs),
            "seconds": round(time.perf_counter() - t0, 2)}


def _lines(docs: list[str]) -> Iterable[str]:
    for d in docs:
        yield from d.splitlines(keepends=True)


# --------------------------------------------------------------------------- models

def size_config(size: str | dict, cfg: dict | None = None) -> dict:
    """Return the LlamaConfig fields of a named size (from cfg['sizes'] or DEFAULTS) or a dict."""
    if isinstance(size, dict):
        return dict(size)
    sizes = (cfg or {}).get("sizes") or DEFAULTS["sizes"]
    if size not in sizes:
        raise InputError(f"unknown model size '{size}'; known: {sorted(sizes)}", field="sizes")
    return dict(sizes[size])


def build_model(tokenizer_dir: str | os.PathLike, size_cfg: dict, seed: int = 0):
    """Build a randomly initialised ``LlamaForCausalLM`` matching the tokenizer.

    Embeddings are tied; vocab size and bos/eos/pad ids come from the tokenizer.
    ``size_cfg`` holds LlamaConfig fields (hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer_dir) if not hasattr(tokenizer_dir, "bos_token_id") else tokenizer_dir
    fields = dict(size_cfg)
    heads = int(fields.get("num_attention_heads", 4))
    if int(fields.get("hidden_size", 128)) % heads:
        raise InputError(f"hidden_size {fields.get('hidden_size')} is not divisible by "
                         f"num_attention_heads {heads}", field="sizes")
    fields.setdefault("num_key_value_heads", heads)
    fields.setdefault("max_position_embeddings", 512)
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def count_params(model) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_model(model, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save model + tokenizer as one HF dir, atomically."""
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


# --------------------------------------------------------------------------- pretraining

def pack_blocks(tokenizer, texts: Iterable[str], block_size: int) -> "np.ndarray":
    """Tokenize documents as ``<s> doc </s>``, concatenate, and cut into full blocks."""
    texts = list(texts)
    ids: list[int] = []
    enc = tokenizer(texts, add_special_tokens=True)["input_ids"]
    for row in enc:
        ids.extend(row)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    if n == 0:
        raise InputError(f"corpus has {len(ids)} tokens, fewer than one block of {block_size}",
                         field="pretrain.block_size")
    return np.asarray(ids[: n * block_size], dtype=np.int64).reshape(n, block_size)


def lr_lambda(schedule: str, warmup: int, total: int, floor: float = 0.1):
    """Multiplier of the peak lr at a step: linear warm-up then cosine/linear decay to floor."""
    if schedule not in ("cosine", "linear", "constant"):
        raise InputError(f"unknown schedule '{schedule}' (cosine|linear|constant)", field="schedule")

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


PRECISIONS = ("auto", "bf16", "fp32")


def native_bf16(device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively (CUDA with bf16, or a CPU with
    AVX512-BF16 or AMX, not capped below them: `clusterft.hardware`); elsewhere bf16
    autocast is emulated and slower than fp32."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        known = hardware.native_bf16_cpu()
        if known is not None:
            return known
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, f, lambda: False)()) for f in probes)
    return False


def resolve_precision(precision: str, device, field: str = "precision") -> str:
    """``auto`` -> ``bf16`` on a CUDA device with bf16, else ``fp32``; checks the name.

    ``bf16`` means autocast: matmuls run in bfloat16 while the weights, the optimiser state
    and the loss stay float32 (the usual mixed-precision recipe). ``auto`` keeps fp32 on
    every CPU: emulated bf16 (CPUs without AVX512-BF16/AMX) is about 10x slower than fp32,
    native bf16 pays off only for some shapes (oneDNN builds its kernels per matrix shape),
    and a default in bf16 on some CPUs and fp32 on others would add a precision difference to
    the float-kernel differences machines already have. An explicit ``bf16`` on a CPU that emulates it warns (on stderr, so in
    the rule's log) and runs as asked.
    """
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision '{precision}' ({'|'.join(PRECISIONS)})", field=field)
    import torch

    device = torch.device(device)
    if precision == "auto":
        return "bf16" if device.type == "cuda" and native_bf16(device) else "fp32"
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        warnings.warn(hardware.emulated_bf16_message(field), stacklevel=2)
    return precision


def pretrain(model, tokenizer, texts: Iterable[str], cfg: dict, seed: int = 0) -> dict:
    """Briefly pretrain ``model`` in place as a causal LM on packed blocks; return metrics."""
    import torch

    from .pace import Pace

    cfg = {**DEFAULTS["pretrain"], **(cfg or {})}
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    block = int(cfg["block_size"])
    if block > model.config.max_position_embeddings:
        raise InputError(f"block_size {block} exceeds max_position_embeddings "
                         f"{model.config.max_position_embeddings}", field="pretrain.block_size")
    blocks = pack_blocks(tokenizer, texts, block)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(blocks))
    n_val = int(len(blocks) * float(cfg["val_fraction"]))
    n_val = min(n_val, 64)
    val, train = blocks[perm[:n_val]], blocks[perm[n_val:]]
    if len(train) == 0:
        raise InputError("no training blocks left after the validation split", field="pretrain.val_fraction")
    steps, bs = int(cfg["steps"]), int(cfg["batch_size"])
    precision = resolve_precision(cfg["precision"], model.device, field="pretrain.precision")
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]),
                            weight_decay=float(cfg["weight_decay"]), betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg["schedule"], int(cfg["warmup_steps"]), steps))
    data = torch.from_numpy(train)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    order = rng.permutation(len(train))
    pos = 0
    with Pace(steps, f"pretrain ({precision})", disable=steps < 2) as pace:
        for _step in range(steps):
            if pos + bs > len(order):
                order, pos = rng.permutation(len(train)), 0
            idx = torch.from_numpy(order[pos:pos + bs]) if bs <= len(order) else torch.from_numpy(order)
            pos += bs
            batch = data[idx]
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            if cfg["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg["grad_clip"]))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            pace.update()
    seconds = time.perf_counter() - t0
    model.eval()
    val_loss = None
    if len(val):
        with torch.no_grad():
            vb = torch.from_numpy(val)
            val_loss = float(np.mean([float(model(input_ids=vb[i:i + bs], labels=vb[i:i + bs]).loss)
                                      for i in range(0, len(vb), bs)]))
    k = max(1, steps // 20)
    return {"steps": steps, "blocks": int(len(train)), "val_blocks": int(n_val),
            "tokens_seen": steps * bs * block, "train_seconds": round(seconds, 2),
            "first_loss": losses[0] if losses else None,
            "final_loss": float(np.mean(losses[-k:])) if losses else None,
            "val_loss": val_loss, "loss_curve": [round(x, 4) for x in losses[::k]],
            "precision": precision, "hardware": hardware.describe()}


def run_base_model(tokenizer_dir: str | os.PathLike, corpus: str | os.PathLike, size_cfg: dict,
                   pretrain_cfg: dict, out_dir: str | os.PathLike, seed: int = 0) -> dict:
    """Stage `base_model`: build a Llama of ``size_cfg``, pretrain it, save model + tokenizer.

    Writes ``out_dir`` (HF dir loadable by AutoModelForCausalLM / lm-eval ``hf``) with a
    ``pretrain_metrics.json`` inside. Returns the metrics.
    """
    set_offline_env()
    import torch

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_dir)
    model = build_model(tok, size_cfg, seed)
    docs = read_corpus(corpus)
    metrics = pretrain(model, tok, docs, pretrain_cfg, seed) if int((pretrain_cfg or {}).get(
        "steps", DEFAULTS["pretrain"]["steps"])) > 0 else {"steps": 0}
    metrics["params"] = count_params(model)
    metrics["size"] = dict(size_cfg)
    metrics["torch_threads"] = torch.get_num_threads()
    tok.model_max_length = int(model.config.max_position_embeddings)
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        metrics["total_seconds"] = round(time.perf_counter() - t0, 2)
        write_json(Path(tmp) / "pretrain_metrics.json", metrics)
    return metrics


def resolve_model(spec: str, allow_downloads: bool = False, field: str = "model",
                  need_config: bool = True) -> str:
    """Return a local model dir for ``spec``, or the hub id itself when downloads are allowed.

    Raises InputError naming ``field`` if ``spec`` is neither an existing dir nor usable.
    """
    if not spec:
        raise InputError("no model given", field=field)
    p = Path(spec).expanduser()
    if p.exists():
        if need_config and not (p / "config.json").exists():
            raise InputError(f"'{spec}' exists but holds no config.json (not an HF model dir)",
                             path=str(p), field=field)
        return str(p)
    if allow_downloads and re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", spec):
        return spec
    raise InputError(f"model '{spec}' is not a local directory, and hub downloads are off "
                     "(set allow_downloads: true to fetch hub ids, or point it at a local model dir)",
                     field=field)


def run_model(tokenizer_dir: str | os.PathLike, corpus: str | os.PathLike, model_cfg: dict,
              out_dir: str | os.PathLike, seed: int = 0, *, name: str = "model",
              allow_downloads: bool = False, threads: int | None = None) -> dict:
    """Stage `base_model` from a config ``models.<name>`` section, dispatching on ``source``.

    - ``build`` (default): ``size`` (a dict of LlamaConfig fields, or a name in
      DEFAULTS['sizes']; default: ``name`` if it is one) + ``pretrain`` (merged over
      DEFAULTS['pretrain']) -> :func:`run_base_model`.
    - ``hub``: ``hub_id`` downloaded (only with allow_downloads) and saved to out_dir.
    - ``path``: an existing local HF model dir, copied to out_dir.
    """
    import shutil

    source = model_cfg.get("source", "build")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    if source == "build":
        size = model_cfg.get("size", name)
        size_cfg = size_config(size)
        pcfg = {**DEFAULTS["pretrain"], **(model_cfg.get("pretrain") or {})}
        return run_base_model(tokenizer_dir, corpus, size_cfg, pcfg, out_dir, seed)
    if source not in ("hub", "path"):
        raise InputError(f"unknown source '{source}' (build|hub|path)", field=f"models.{name}.source")
    key = "hub_id" if source == "hub" else "path"
    spec = resolve_model(model_cfg.get(key, ""), allow_downloads, field=f"models.{name}.{key}")
    t0 = time.perf_counter()
    with atomic_path(out_dir, is_dir=True) as tmp:
        if source == "path":
            shutil.copytree(spec, tmp, dirs_exist_ok=True)
        else:
            set_offline_env(allow_downloads=True)
            from transformers import AutoModelForCausalLM, AutoTokenizer

            AutoModelForCausalLM.from_pretrained(spec).save_pretrained(str(tmp))
            AutoTokenizer.from_pretrained(spec).save_pretrained(str(tmp))
    return {"source": source, "spec": spec, "seconds": round(time.perf_counter() - t0, 2)}
