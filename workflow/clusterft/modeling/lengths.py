"""``max_length: auto``: the token length that covers a quantile of the run's pool.

score, features and train each cut examples at their section's ``max_length``. A fixed value
fits the pools one knows; ``auto`` measures the pool instead, in the job that reads it:

1. every pool example is rendered and tokenised exactly as the stages encode it
   (``clusterft.modeling.tokenize.encode_example``: ``<s>`` + prompt, response + ``</s>``,
   untruncated), with the model's own tokenizer;
2. the ``max_length_quantile`` quantile of those lengths (the smallest length at least that
   share of the examples fit in: the order statistic ``ceil(q N)``, exact in q) is rounded
   up to a multiple of ``MULTIPLE`` (64 tokens: whole tiles for the GPU kernels, and a
   margin);
3. the result is capped at ``max_length_cap``, at the model's context
   (``max_position_embeddings`` of its config.json) and at the tokenizer's
   ``model_max_length`` where that is a real limit (transformers' "no limit" is 1e30).

One pure function (:func:`resolve_max_length`) of the lengths and the three numbers, so every
stage that reads one pool with one model's tokenizer and the same quantile and cap resolves
the same value; the jobs record it (``max_length``, and ``max_length_source``: "auto q0.99
of N examples") in their metrics and provenance. Tokenising a pool once more costs seconds
per 10^4 examples with a fast tokenizer, inside jobs that run for hours on 7B models.
"""

from __future__ import annotations

import json
import logging
import math
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Sequence

from clusterft.pipeline.errors import InputError

log = logging.getLogger(__name__)

AUTO = "auto"
MULTIPLE = 64           # auto lengths are rounded up to a multiple of this many tokens
DEFAULT_QUANTILE = 0.99  # the *.max_length_quantile default
DEFAULT_CAP = 4096       # the *.max_length_cap default (Llama-2's context)
NO_LIMIT = 10 ** 6       # a tokenizer model_max_length at or above this is "no limit"
MIN_LENGTH = 4           # encode_example's smallest max_length
CHUNK = 1024             # examples per batched tokenizer call


def is_auto(value: Any) -> bool:
    """Whether a max_length value is the string ``auto``."""
    return isinstance(value, str) and value == AUTO


def resolve_max_length(lengths: Iterable[int], quantile: float, multiple: int = MULTIPLE,
                       cap: int | None = None) -> int:
    """The ``quantile`` quantile of ``lengths`` (the smallest length that at least that share
    of them do not exceed), rounded up to a multiple of ``multiple`` (and to at least 4), at
    most ``cap``."""
    xs = sorted(int(x) for x in lengths)
    if not xs:
        raise InputError("no examples to measure a max_length from", field="pool")
    q = Fraction(str(quantile))  # 0.99 is 99/100 exactly: no float rounding in ceil(q N)
    if not 0 < q <= 1:
        raise InputError(f"the quantile must be in (0, 1], got {quantile!r}",
                         field="max_length_quantile")
    if cap is not None and int(cap) < MIN_LENGTH:
        raise InputError(f"the cap must be >= {MIN_LENGTH} tokens, got {cap}",
                         field="max_length_cap")
    k = max(1, math.ceil(q * len(xs)))
    m = max(1, int(multiple))
    value = max(MIN_LENGTH, -(-xs[k - 1] // m) * m)  # encode_example's smallest max_length
    return min(value, int(cap)) if cap is not None else value


def example_lengths(tokenizer, records: Sequence[dict]) -> list[int]:
    """Untruncated token length of each pool record as ``encode_example`` builds it
    (BOS + prompt, response + EOS), tokenised in batches."""
    from clusterft.modeling.prompt import render_example
    from clusterft.modeling.tokenize import check_messages

    out: list[int] = []
    bos = tokenizer.bos_token_id
    for lo in range(0, len(records), CHUNK):
        prompts, responses = [], []
        for i, rec in enumerate(records[lo:lo + CHUNK], start=lo):
            try:
                check_messages(rec.get("messages"))
            except InputError as e:
                raise InputError(f"record {i} (id {rec.get('id')!r}): {e.message}",
                                 field="messages") from e
            p, r = render_example(rec["messages"])
            prompts.append(p)
            responses.append(r)
        p_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
        for p, r in zip(p_ids, r_ids):
            out.append(len(p) + (0 if p and p[0] == bos else 1) + len(r) + 1)
    return out


def model_context(model_dir: str | Path | None) -> int | None:
    """``max_position_embeddings`` of a model folder's config.json (None where unknown)."""
    cfg = Path(str(model_dir or "")) / "config.json"
    if not model_dir or not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def check_keys(out: dict, section: str) -> None:
    """A merged section's max_length (an integer >= 1 or auto), max_length_quantile (in
    (0, 1]) and max_length_cap (an integer >= 4); InputError naming the field."""
    ml = out["max_length"]
    if isinstance(ml, str) and not is_auto(ml):
        raise InputError(f"must be an integer or '{AUTO}', got {ml!r}",
                         field=f"{section}.max_length")
    q = out.get("max_length_quantile", DEFAULT_QUANTILE)
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise InputError(f"must be in (0, 1], got {q!r}", field=f"{section}.max_length_quantile")
    cap = out.get("max_length_cap", DEFAULT_CAP)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < MIN_LENGTH:
        raise InputError(f"must be an integer >= {MIN_LENGTH}, got {cap!r}",
                         field=f"{section}.max_length_cap")


_LAST: list = []  # (tokenizer, records, lengths) of the last measure: score measures twice


def _measured(tokenizer, records: Sequence[dict]) -> list[int]:
    if _LAST and _LAST[0] is tokenizer and _LAST[1] is records:
        return _LAST[2]
    lengths = example_lengths(tokenizer, records)
    _LAST[:] = [tokenizer, records, lengths]
    return lengths


def resolve_lengths(cfg: dict, section: str, tokenizer, pool: Any,
                    model_dir: str | Path | None = None) -> tuple[dict, dict]:
    """(``cfg`` with its max_length an integer, what the job records): ``cfg`` as it is and
    {} unless its max_length is ``auto``; then the value :func:`resolve_max_length` gives
    for ``pool`` (the pool's records, or a function that reads them: called for auto only)
    under ``tokenizer``, and
    {"max_length": value, "max_length_source": "auto q0.99 of N examples[, capped ...]"}.
    ``model_dir``: the model folder whose context caps the value (default: the folder the
    tokenizer was loaded from)."""
    if not is_auto(cfg.get("max_length")):
        return cfg, {}
    if callable(pool):
        pool = pool()
    q = cfg.get("max_length_quantile", DEFAULT_QUANTILE)
    caps = [(int(cfg.get("max_length_cap", DEFAULT_CAP)), f"{section}.max_length_cap")]
    context = model_context(model_dir or getattr(tokenizer, "name_or_path", None))
    if context:
        caps.append((context, "the model's max_position_embeddings"))
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < NO_LIMIT:
        caps.append((limit, "the tokenizer's model_max_length"))
    cap, why = min(caps)
    lengths = _measured(tokenizer, pool)
    value = resolve_max_length(lengths, q, MULTIPLE, cap)
    uncapped = resolve_max_length(lengths, q, MULTIPLE)
    source = f"auto q{q:g} of {len(lengths)} examples"
    if uncapped > value:
        source += f", capped at {cap} ({why})"
    over = sum(x > value for x in lengths)
    log.info("%s.max_length auto: %d tokens (%s; %d of %d examples longer)", section, value,
             source, over, len(lengths))
    return {**cfg, "max_length": value}, {"max_length": value, "max_length_source": source}


__all__ = ["AUTO", "DEFAULT_CAP", "DEFAULT_QUANTILE", "MULTIPLE", "check_keys",
           "example_lengths", "is_auto", "model_context", "resolve_lengths",
           "resolve_max_length"]
