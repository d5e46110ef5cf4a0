"""Cheaper per-example features than score's gradients, in exactly score's format.

A baseline for the question "do gradient clusters find the skills better than words do?":
the same ``cluster`` and ``select`` code runs on these features unchanged.

Kinds (``KINDS``):

- ``embedding``: what the base model *reads*, not how it would learn. Each example is
  tokenised like training and scoring (``clusterft.modeling.tokenize.encode_example``, ``<s>
  prompt response </s>``, truncated to ``max_length``); its feature is the mean, over
  every attended token of that sequence (BOS, prompt, response and EOS; padding excluded
  by the attention mask), of the model's **last hidden state**: the output of the last
  decoder layer *after the final norm*. That is the base model's ``last_hidden_state``,
  which is exactly what HF causal LMs return as ``hidden_states[-1]`` with
  ``output_hidden_states=True`` (transformers ties the two); the base model is asked for
  that one tensor only, so neither every layer's states nor the ``[B, T, vocab]`` logits
  are kept. Batches are formed from length-sorted examples (right padding; causal
  attention, so an example's row does not depend on its batch mates), under
  ``torch.no_grad`` in eval mode; the model is left as it was (training flag, device).
  ``dim`` is the model's hidden size (``features.dim`` does not apply).
- ``tfidf``: what the example *says*. scikit-learn's ``TfidfVectorizer`` over the rendered
  example (``clusterft.modeling.prompt.render_example``: prompt and response text, without the
  fixed ``### Instruction:`` / ``### Response:`` markers every example shares) with
  ``sublinear_tf=True`` (1 + log tf), lower-casing, smooth idf, L2-normalised rows and
  ``TOKEN_PATTERN``: every run of word characters (identifiers such as ``snake_case``
  stay whole; numbers and one-letter names are kept) and every single punctuation or
  operator character (brackets, ``=``, ``:``, ``#``, ``.``: what tells code from prose).
  Reduced with ``TruncatedSVD(n_components=dim, algorithm="randomized",
  random_state=seed)`` (LSA); ``dim`` is capped at ``min(N, vocabulary size)``, beyond
  which the matrix has no more directions, with a logged warning, so the features have
  fewer columns than asked. Deterministic in ``seed``. Needs no model.

Both kinds give float32 ``[N, dim]`` rows, L2-normalised, in pool order. A row that is
(numerically) zero has no direction: an example with no tokens under ``TOKEN_PATTERN``, or
whose terms lie outside every kept SVD component, raises InputError naming its id.

Target features (``embedding`` only; for RDS+, ``clusterft.tasks.targets.rds_round_robin``): with
``targets`` (the benchmark tasks' validation examples, ``clusterft.tasks.targets.val_records``),
the same embedding of each target example, computed after the pool's in a pass of its own
(the pool's rows are the same bytes with or without targets).

``run_features`` is the file I/O edge: pool JSONL (+ HF model dir for ``embedding``) in,
``features.npy`` and ``scores.parquet`` (id, score, grad_norm) out, as ``run_score``
writes them (and with ``targets``, the target features and their ids, as ``run_score``): ``score`` is the mean cosine of the row with every other row (score's
``pool_scores``), ``grad_norm`` is NaN (no gradient). The provenance sidecars carry the
pool's (and model's) lineage and one ``score_run`` digest of the pair, so ``cluster``
accepts the two as coming from one run.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import numpy as np

from clusterft.modeling import cpu_matmul
from clusterft.pipeline import provenance
from clusterft.modeling.distributed import DEVICES, resolve_device
from clusterft.modeling.lengths import check_keys as check_lengths
from clusterft.modeling.lengths import is_auto, resolve_lengths
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.rows import pool_scores
from clusterft.pools.poolfile import load_pool
from clusterft.pipeline.sections import merge_section

log = logging.getLogger(__name__)

DEFAULTS: dict = {
    # Examples per batched forward pass (embedding only).
    "batch_size": 16,
    # Examples are tokenised like training and truncated to this many tokens (embedding
    # only; see clusterft.modeling.tokenize). auto: measured from the run's pool, as
    # score.max_length auto (clusterft.modeling.lengths).
    "max_length": 256,
    # max_length auto: the share of the pool's examples that fit uncut.
    "max_length_quantile": 0.99,
    # max_length auto: never more than this many tokens (nor the model's context).
    "max_length_cap": 4096,
    # TruncatedSVD components (tfidf only; capped at min(pool size, vocabulary size)).
    # The embedding's dimension is the model's hidden size.
    "dim": 128,
    # Device of the embedding pass: auto (cuda if available, else cpu), cpu, cuda, cuda:N.
    "device": "auto",
    # auto | bf16 | fp32 (embedding only), as score.precision: bf16 runs the forward passes
    # under bfloat16 autocast and, on a CUDA GPU, loads the frozen base in bfloat16 straight
    # onto it (clusterft.modeling.precision.base_dtype); the mean over tokens is float32.
    # auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU.
    "precision": "auto",
    # Torch intra-op threads (embedding) and BLAS threads (tfidf's SVD); 0 leaves them as
    # they are (run_features' `threads` argument, e.g. Snakemake's, when given).
    "num_threads": 1,
}

KINDS = ("embedding", "tfidf")

# Word-character runs (any script; identifiers, numbers, one-letter names) and single
# punctuation / operator characters. No capture group (scikit-learn would use the group).
TOKEN_PATTERN = r"(?u)\w+|[^\w\s]"
# A row whose norm is below this (after the SVD; TF-IDF rows have norm 1 before it) is
# treated as zero: normalising it would turn rounding noise into a direction.
ZERO_NORM = 1e-6


def merge_cfg(cfg: dict | None) -> dict:
    """Return ``cfg`` merged over DEFAULTS; unknown keys and bad values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "features")
    for key in ("dim", "batch_size"):
        if int(out[key]) < 1:
            raise InputError(f"must be >= 1, got {out[key]}", field=f"features.{key}")
    check_lengths(out, "features")
    if not is_auto(out["max_length"]) and int(out["max_length"]) < 4:
        raise InputError(f"must be >= 4, got {out['max_length']}", field="features.max_length")
    if int(out["num_threads"]) < 0:
        raise InputError(f"must be >= 0, got {out['num_threads']}", field="features.num_threads")
    from clusterft.modeling.precision import PRECISIONS

    if out["precision"] not in PRECISIONS:
        raise InputError(f"unknown value '{out['precision']}'; valid: {', '.join(PRECISIONS)}",
                         field="features.precision")
    dev = str(out["device"])
    if dev not in (*DEVICES, "mps") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise InputError(f"unknown device '{dev}'; valid: {', '.join(DEVICES)}, cuda:N, mps",
                         field="features.device")
    return out


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InputError(f"unknown feature kind '{kind}'; valid: {', '.join(KINDS)}", field="kind")
    return kind


def _ids(examples: Sequence[dict], rows) -> list:
    return [examples[int(i)].get("id", int(i)) for i in rows]


def normalize_rows(x: np.ndarray, examples: Sequence[dict], why: str) -> np.ndarray:
    """Rows scaled to unit L2 norm, float32; zero or non-finite rows raise InputError
    naming the examples' ids (``why``: what such a row means for this feature kind)."""
    x = np.asarray(x, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad):
        raise InputError(f"non-finite features for {len(bad)} of {len(x)} examples (ids "
                         f"{_ids(examples, bad[:5])}): the model overflows", field="features")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    zero = np.flatnonzero(norms[:, 0] <= ZERO_NORM)
    if len(zero):
        raise InputError(f"all-zero feature rows for {len(zero)} of {len(x)} examples (ids "
                         f"{_ids(examples, zero[:5])}): {why}", field="features")
    return (x / norms).astype(np.float32)


# --------------------------------------------------------------------------- embedding

def _base_model(model):
    """The decoder under an HF causal LM (``model.model`` for Llama); the model itself if it
    is already one."""
    base = getattr(model, "base_model", None)
    return model if base is None else base


def embedding_features(model, tokenizer, examples: Sequence[dict], cfg: dict | None) -> np.ndarray:
    """Mean last hidden state (after the final norm) over each example's tokens, L2-normalised:
    float32 [N, hidden_size] in the order of ``examples`` (see the module docstring).

    ``model`` is an HF causal LM (or its base model); it is left as it was on return
    (weights, training flag, device). Deterministic: the features depend on no seed.
    """
    import contextlib

    import torch

    from clusterft.modeling.precision import autocast, resolve_precision
    from clusterft.modeling.tokenize import collate, encode_truncated

    cfg = merge_cfg(cfg)
    if len(examples) == 0:
        raise InputError("no examples to embed", field="pool")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise InputError("tokenizer has no pad token", field="model")
    cfg, _ = resolve_lengths(cfg, "features", tokenizer, examples)  # auto: these examples'
    encoded, _ = encode_truncated(tokenizer, examples, int(cfg["max_length"]))
    device = resolve_device(cfg["device"], "features.device")
    precision = resolve_precision(cfg["precision"], device, "features.precision")
    base = _base_model(model)
    first = next(model.parameters(), None)
    home = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    threads = torch.get_num_threads()
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    order = np.argsort([e["length"] for e in encoded], kind="stable")
    bs = int(cfg["batch_size"])
    rows: np.ndarray | None = None
    try:
        model.to(device)
        model.eval()
        # fp32: no context at all, so the embedded default computes as it always did
        with torch.no_grad(), (autocast(device, precision) if precision == "bf16"
                               else contextlib.nullcontext()):
            for lo in range(0, len(order), bs):
                idx = order[lo:lo + bs]
                batch = collate([encoded[i] for i in idx], pad_id)
                ids = batch["input_ids"].to(device)
                mask = batch["attention_mask"].to(device)
                out = base(input_ids=ids, attention_mask=mask, use_cache=False)
                h = out.last_hidden_state.float()  # == causal LM hidden_states[-1]
                m = mask.unsqueeze(-1).to(h.dtype)
                mean = (h * m).sum(1) / m.sum(1)
                if rows is None:
                    rows = np.zeros((len(encoded), mean.shape[1]), dtype=np.float64)
                rows[idx] = mean.double().cpu().numpy()
    finally:
        model.train(was_training)
        model.to(home)
        torch.set_num_threads(threads)
    return normalize_rows(rows, examples, "the model's hidden states average to zero")


def _load_kwargs(cfg: dict) -> dict:
    """load_causal_lm's dtype and device for the embedding pass: a frozen base in bfloat16
    straight onto a CUDA device in bf16 (``precision.base_dtype``); nothing on a CPU, where
    the base loads float32 as before."""
    import torch

    from clusterft.modeling.precision import base_dtype, resolve_precision

    device = torch.device(resolve_device(cfg["device"], "features.device"))
    if device.type != "cuda":
        return {}
    precision = resolve_precision(cfg["precision"], device, "features.precision")
    return {"dtype": base_dtype(precision, device, "lora"), "device": device}


# --------------------------------------------------------------------------- tfidf

def example_text(messages: list[dict]) -> str:
    """The rendered example (prompt and response) without the fixed template markers."""
    from clusterft.modeling.prompt import INSTRUCTION, RESPONSE, render_example
    from clusterft.modeling.tokenize import check_messages

    check_messages(messages)
    prompt, response = render_example(messages)
    return prompt.removeprefix(INSTRUCTION).removesuffix(RESPONSE) + "\n\n" + response


def tfidf_features(examples: Sequence[dict], cfg: dict | None, seed: int = 0) -> np.ndarray:
    """TF-IDF of each rendered example reduced by a seeded TruncatedSVD (LSA), L2-normalised:
    float32 [N, min(dim, N, vocabulary size)] in the order of ``examples`` (see the module
    docstring for the settings). Deterministic in ``seed``."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from threadpoolctl import threadpool_limits

    cfg = merge_cfg(cfg)
    if len(examples) == 0:
        raise InputError("no examples for tfidf features", field="pool")
    if int(seed) < 0:
        raise InputError(f"seed must be >= 0, got {seed}", field="seed")
    texts = []
    for i, ex in enumerate(examples):
        try:
            texts.append(example_text(ex.get("messages")))
        except InputError as e:
            raise InputError(f"example {i} (id {ex.get('id')!r}): {e}", field="messages") from e
    vec = TfidfVectorizer(token_pattern=TOKEN_PATTERN, sublinear_tf=True, lowercase=True,
                          dtype=np.float64)
    try:
        x = vec.fit_transform(texts)
    except ValueError as e:  # "empty vocabulary": no example has a single token
        raise InputError(f"no example has a token under the tfidf token pattern ({e}); ids "
                         f"{_ids(examples, range(min(5, len(examples))))}", field="features") from e
    empty = np.flatnonzero(x.getnnz(axis=1) == 0)
    if len(empty):
        raise InputError(f"{len(empty)} of {len(texts)} examples have no tokens under the tfidf "
                         f"token pattern {TOKEN_PATTERN!r} (ids {_ids(examples, empty[:5])}): "
                         "their text is empty", field="features")
    n, vocab = x.shape
    if vocab < 2:
        raise InputError(f"the pool's text has only {vocab} distinct token(s); tfidf needs >= 2 "
                         f"(ids {_ids(examples, range(min(5, n)))})", field="features")
    dim = min(int(cfg["dim"]), n, vocab)
    if dim < int(cfg["dim"]):
        log.warning("tfidf: features.dim = %d capped to %d (%d examples, vocabulary of %d "
                    "tokens: the TF-IDF matrix has no more directions)", cfg["dim"], dim, n, vocab)
    svd = TruncatedSVD(n_components=dim, algorithm="randomized", random_state=int(seed))
    limit = int(cfg["num_threads"]) or None
    # errstate: one example has zero variance, and sklearn's explained-variance ratio is 0/0
    with threadpool_limits(limits=limit), np.errstate(invalid="ignore", divide="ignore"):
        z = svd.fit_transform(x)
    return normalize_rows(z, examples, f"their terms lie outside all {dim} kept SVD components "
                          "(they share no terms with the rest of the pool); raise features.dim")


# --------------------------------------------------------------------------- stage edge

def run_features(kind: str, pool: str | os.PathLike, out_features: str | os.PathLike,
                 out_scores: str | os.PathLike, cfg: dict | None = None, seed: int = 0,
                 model_dir: str | os.PathLike | None = None, threads: int | None = None,
                 targets=None, out_targets: str | os.PathLike | None = None,
                 out_target_ids: str | os.PathLike | None = None) -> dict:
    """Write ``kind`` features as score does: features.npy [N, dim] float32 (pool order) and
    scores.parquet (id, score = mean cosine with the other rows, grad_norm = NaN), each
    with a provenance sidecar (stage ``features-<kind>``; lineage of the pool, of the model
    for ``embedding``, and ``score_run`` for the pair, so ``cluster`` takes them together).

    ``model_dir`` is needed for ``embedding`` only (``tfidf`` ignores it). ``threads``
    (e.g. Snakemake's) applies when cfg's num_threads is 0. Returns {kind, n, dim, seconds}
    (and n_targets).

    ``targets`` (``embedding`` only; for RDS+): as ``score.run_score``'s, ``(items_dir,
    tasks)`` / ``{"items_dir", "tasks"}`` (the items folder is checked as an input) or
    ``(records, task_of_record)`` from ``clusterft.tasks.targets.val_records``; writes
    ``out_targets`` (float32 [M, dim] .npy, role "targets") and ``out_target_ids``
    (parquet: id, task; role "target_ids").
    """
    import pandas as pd

    from clusterft.pipeline.io import save_npy, set_offline_env, write_parquet
    from clusterft.tasks.targets import check_outputs, resolve_targets, write_outputs

    set_offline_env()
    _check_kind(kind)
    cfg = merge_cfg(cfg)
    check_outputs(targets, out_targets, out_target_ids)
    if (targets is not None or out_targets is not None) and kind != "embedding":
        raise InputError(f"target features are made for kind 'embedding' only, not '{kind}'",
                         field="targets")
    if threads and not cfg["num_threads"]:
        cfg = {**cfg, "num_threads": int(threads)}
    t0 = time.perf_counter()
    records = load_pool(pool)
    t_records, t_tasks, t_dirs = resolve_targets(targets) if targets is not None else (None, [], [])
    target_rows, lengths = None, {}
    if kind == "embedding":
        from clusterft.modeling.hf import load_causal_lm, load_tokenizer, resolve_model

        if model_dir is None:
            raise InputError("embedding features need a model (model_dir)", field="features model")
        path = resolve_model(str(model_dir), field="features model")
        cpu_matmul.from_env()
        checked = provenance.check_inputs({"model": path, "pool": pool, "items": t_dirs or None},
                                          f"features-{kind}")
        tok = load_tokenizer(path)
        cfg, lengths = resolve_lengths(cfg, "features", tok, records, path)  # max_length auto
        model = load_causal_lm(path, **_load_kwargs(cfg))
        features = embedding_features(model, tok, records, cfg)
        if t_records is not None:  # a pass of its own, after the pool's
            target_rows = embedding_features(model, tok, t_records, cfg)
    else:
        checked = provenance.check_inputs({"pool": pool}, f"features-{kind}")
        features = tfidf_features(records, cfg, seed)
    save_npy(out_features, features)
    write_parquet(out_scores, pd.DataFrame({"id": [r["id"] for r in records],
                                            "score": pool_scores(features).astype(np.float64),
                                            "grad_norm": np.full(len(records), np.nan)}))
    outputs = {"features": out_features, "scores": out_scores}
    if out_targets is not None:
        outputs.update(write_outputs(out_targets, out_target_ids, target_rows, t_records,
                                     t_tasks, features.shape[1]))
    provenance.write(outputs, f"features-{kind}", checked, inherit=("pool", "model", "items"),
                     run_key="score_run", config={"kind": kind, **cfg, **lengths}, seed=seed)
    info = {"kind": kind, "n": len(records), "dim": int(features.shape[1]),
            "seconds": round(time.perf_counter() - t0, 2), **lengths}
    if target_rows is not None:
        info["n_targets"] = len(target_rows)
    log.info("%s features of %d examples (dim %d) in %.1fs", kind, info["n"], info["dim"],
             info["seconds"])
    return info
