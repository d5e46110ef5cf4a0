"""Shared tokenisation of pool examples for training and scoring.

An example is ``<s> prompt response </s>`` with labels -100 on ``<s>`` and the prompt, so
the loss is on the response tokens and EOS only. Prompt and response are tokenised
separately (the prompt format ends with a newline, so BPE never merges across the
boundary) and concatenated.

Truncation policy when the example is longer than ``max_length``:
- ``truncate``: keep the prompt whole if at least one response token still fits and cut
  the response (and EOS) at the right. If the prompt leaves no room, the response keeps
  up to ``max_length // 2`` tokens and the prompt is cut at the LEFT after ``<s>`` (its
  end, ``### Response:``, is what the model needs to see last).
- ``reject``: return ``None``; the caller drops the example and counts it.
- ``error``: raise InputError naming the example (file, line, id) and its length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from clusterft.pipeline.errors import InputError
from clusterft.modeling.prompt import render_example

if TYPE_CHECKING:  # torch loads lazily: the workflow imports the names here at parse time
    import torch

IGNORE_INDEX = -100
POLICIES = ("truncate", "reject", "error")
# What train applies to over-long examples unless configured (train.DEFAULTS takes these;
# score checks the pool against them first).
LENGTH_POLICY = {"max_length": 256, "truncation": "truncate"}


def check_messages(messages, where: str | None = None, line: int | None = None) -> None:
    """Raise InputError unless messages is a list ending with one assistant message."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", path=where, line=line, field="messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
                "user", "assistant", "system"):
            raise InputError("each message needs role user|assistant|system and string content",
                             path=where, line=line, field="messages")
    if messages[-1]["role"] != "assistant":
        raise InputError("the last message must be the assistant's", path=where, line=line,
                         field="messages")


def encode_example(tokenizer, messages: list[dict], max_length: int,
                   policy: str = "truncate") -> dict | None:
    """Tokenise one example; returns dict(input_ids, labels, length, truncated) or None.

    ``None`` only under ``policy='reject'`` when the example is longer than ``max_length``;
    under ``policy='error'`` such an example raises InputError (field ``messages``).
    """
    if policy not in POLICIES:
        raise InputError(f"unknown truncation policy '{policy}' ({'|'.join(POLICIES)})",
                         field="truncation")
    if max_length < 4:
        raise InputError(f"max_length must be >= 4, got {max_length}", field="max_length")
    check_messages(messages)
    prompt, response = render_example(messages)
    p_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not p_ids or p_ids[0] != tokenizer.bos_token_id:  # tokenizer without a BOS template
        p_ids = [tokenizer.bos_token_id] + p_ids
    r_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    truncated = len(p_ids) + len(r_ids) > max_length
    if truncated:
        if policy == "reject":
            return None
        if policy == "error":
            raise InputError(f"example is {len(p_ids) + len(r_ids)} tokens, longer than "
                             f"max_length = {max_length} (truncation policy 'error'; use "
                             "truncate or reject to keep going)", field="messages")
        room = max_length - len(p_ids)
        if room >= 1:
            r_ids = r_ids[:room]
        else:
            keep_r = min(len(r_ids), max_length // 2)
            r_ids = r_ids[:keep_r]
            keep_p = max_length - keep_r
            p_ids = p_ids[:1] + p_ids[len(p_ids) - (keep_p - 1):]
    input_ids = p_ids + r_ids
    labels = [IGNORE_INDEX] * len(p_ids) + r_ids
    return {"input_ids": input_ids, "labels": labels, "length": len(input_ids),
            "truncated": truncated}


def encode_records(tokenizer, records: Sequence[dict], max_length: int,
                   policy: str = "truncate", where: str | None = None,
                   lines: Sequence[int] | None = None) -> tuple[list[dict], list[int]]:
    """Encode pool records; returns (encoded kept examples, indices of rejected ones).

    Errors name `where` (the pool file), the record's line (`lines[i]`, else i + 1) and id.
    """
    kept, rejected = [], []
    for i, rec in enumerate(records):
        try:
            enc = encode_example(tokenizer, rec["messages"], max_length, policy)
        except InputError as e:
            if e.path is not None or where is None:
                raise
            raise InputError(f"record id {rec.get('id')!r}: {e.message}", path=where,
                             line=lines[i] if lines is not None else i + 1, field=e.field) from e
        if enc is None:
            rejected.append(i)
        else:
            enc["id"] = rec.get("id")
            kept.append(enc)
    return kept, rejected


def encode_truncated(tokenizer, examples: Sequence[dict], max_length: int,
                     what: str = "examples") -> tuple[list[dict], int]:
    """Encode every example, cutting over-long ones (scoring and feature passes see the whole
    pool); returns (encoded, how many were truncated) and logs that count. Errors name the
    example's position and id."""
    import logging

    encoded = []
    for i, ex in enumerate(examples):
        try:
            encoded.append(encode_example(tokenizer, ex.get("messages"), int(max_length),
                                          "truncate"))
        except InputError as e:
            raise InputError(f"{what[:-1]} {i} (id {ex.get('id')!r}): {e}",
                             field="messages") from e
    n_trunc = sum(bool(e["truncated"]) for e in encoded)
    if n_trunc:
        logging.getLogger(__name__).warning("%d of %d %s truncated to max_length=%d", n_trunc,
                                            len(encoded), what, int(max_length))
    return encoded, n_trunc


def check_length_policy(tokenizer, records: Sequence[dict], max_length: int, policy: str,
                        where: str) -> dict[str, int]:
    """Apply train's over-long policy to a whole pool before any expensive stage.

    Raises InputError naming `where`, the line and the record id of the first over-long
    example under ``policy='error'``, or field ``train.max_length`` when ``'reject'`` would
    leave nothing. Returns counts {n, too_long} (truncated or rejected later by train).
    """
    kept, rejected = encode_records(tokenizer, records, max_length, policy, where=where)
    if policy == "reject" and not kept:
        raise InputError(f"all {len(records)} records are longer than max_length = {max_length} "
                         "and truncation = 'reject' would drop them: nothing left to train on "
                         "(raise train.max_length or use truncate)", path=where,
                         field="train.max_length")
    too_long = len(rejected) + sum(bool(e["truncated"]) for e in kept)
    return {"n": len(records), "too_long": int(too_long)}


class Collator:
    """Pad a list of encoded examples to the longest one (right padding).

    Returns input_ids (pad id), labels (-100 on padding) and attention_mask, as int64
    tensors of shape [batch, longest], the longest rounded up to a multiple of
    ``pad_to_multiple_of`` (1: no rounding).
    """

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 1) -> None:
        self.pad_id = int(pad_id)
        self.multiple = max(1, int(pad_to_multiple_of))

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        import torch

        n = round_up(max(len(b["input_ids"]) for b in batch), self.multiple)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            k = len(b["input_ids"])
            ids[i, :k] = torch.as_tensor(b["input_ids"], dtype=torch.long)
            labels[i, :k] = torch.as_tensor(b["labels"], dtype=torch.long)
            mask[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    m = max(1, int(multiple))
    return -(-int(n) // m) * m


def collate(batch: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Functional form of :class:`Collator`."""
    return Collator(pad_id)(batch)
