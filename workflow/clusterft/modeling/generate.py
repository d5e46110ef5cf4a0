"""Greedy answers of a model to prompts, and how many of an answer's words they get right.

Not the benchmark path (lm-eval scores every reported number): this is the quick in-process
check that a stage uses on its own generated items, e.g. whether a practised base model
answers its practice ciphers (clusterft.stages.models) or a testbed pilot's arms
(benchmarks/testbed_pilot.py), where lm-eval's start-up would cost more than the answers.
"""

from __future__ import annotations

import numpy as np


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 16,
                   batch: int = 64) -> list[str]:
    """Greedy continuations (left-padded batches), stripped, up to the first newline: what
    lm-eval's generate_until with until ["\\n"] compares."""
    import torch

    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch):
                enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True,
                                add_special_tokens=True).to(model.device)
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=pad)
                for row in gen[:, enc["input_ids"].shape[1]:]:
                    out.append(tokenizer.decode(row, skip_special_tokens=True)
                               .split("\n")[0].strip())
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def word_share(answer: str, got: str) -> float:
    """The share of the answer's words that ``got`` has in the same place (a continuous
    score: an answer half right counts half)."""
    want, have = answer.split(), got.split()
    return float(np.mean([i < len(have) and have[i] == w for i, w in enumerate(want)]))


def score_items(model, tokenizer, items: list[dict], max_new_tokens: int = 16) -> dict:
    """Exact match and word share of greedy answers to ``items`` (dicts with prompt, answer
    and group), overall and macro over the groups, with the per-group values."""
    got = greedy_answers(model, tokenizer, [it["prompt"] for it in items], max_new_tokens)
    exact: dict[str, list[float]] = {}
    words: dict[str, list[float]] = {}
    for it, g in zip(items, got):
        exact.setdefault(it["group"], []).append(float(g == it["answer"]))
        words.setdefault(it["group"], []).append(word_share(it["answer"], g))
    per = {k: float(np.mean(v)) for k, v in exact.items()}
    per_word = {k: float(np.mean(v)) for k, v in words.items()}
    return {"exact": float(np.mean([x for v in exact.values() for x in v])),
            "macro": float(np.mean(list(per.values()))),
            "word_macro": float(np.mean(list(per_word.values()))),
            "per_group": per, "per_group_word": per_word}
