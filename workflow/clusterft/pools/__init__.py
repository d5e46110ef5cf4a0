"""Instruction pools: shared building blocks and the overlap (contamination) checks.

Each pool module (`skills`, `pycode`, `icd10`) exposes `DEFAULTS` and
`build(cfg, seed) -> Built`: it draws the benchmark items FIRST, then pool candidates that
avoid the held-out inputs by construction, then drops every candidate that the generic
check below finds too close to a benchmark item, and finally picks the pool.

Validation items (`val_per_task` per task, `Built.val_items`; for the target-aware
baselines LESS and RDS+, `clusterft.tasks.targets`): drawn by the same task generators from a
SEPARATE seeded random stream and from the held-out side only (inputs the test items did
not use, never pool inputs), so the test items and the pool are the same with or without
them. `drop_overlapping` then drops every validation item that the check below finds too
close to a test item (`clusterft.stages.data.prepare` writes the rest to `<task>.val.jsonl`).

Overlap check (`OverlapIndex`), on (prompt, response) pairs of normalised text (lowercase
words of letters and digits):
- exact: the same normalised prompt + response;
- 13-gram: a shared word n-gram (n = 13) holding at least `min_content_words` content
  words;
- high overlap: for pairs that share a non-boilerplate word 4-gram, with template words
  removed, the word-sequence similarity (difflib ratio) or the share of the item's words
  found in order in the pool text is >= `similarity` (e.g. the same word list with a word
  added, a function body with one name changed, a description with a word appended).
Templates must not count as overlap: a word or 4-gram found in at least `boilerplate_df` of
the pool candidates (and at least `boilerplate_min` of them) is boilerplate (template words
= words inside a boilerplate 4-gram), and a response shared by at least `label_min` pool
candidates is a class label (a chapter title, a Roman numeral, a count), left out of the
compared text. Without this, a long template plus a closed-set answer ("... Answer with
the Roman numeral." -> "XII") would flag every templated item.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from types import ModuleType
from typing import Iterable, Mapping, Sequence

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.modeling.prompt import render_example

POOL_NAMES = ("skills", "pycode", "icd10", "cipher")

OVERLAP_DEFAULTS: dict = {
    # Word n-gram length of the near-duplicate check (13 as in GPT-3's decontamination).
    "ngram_n": 13,
    # A word or 4-gram in at least this fraction of the pool candidates is boilerplate
    # (template text) ...
    "boilerplate_df": 0.01,
    # ... and in at least this many candidates (so small pools keep their payload words).
    "boilerplate_min": 20,
    # A shared n-gram counts only if it holds at least this many content (non-boilerplate) words.
    "min_content_words": 3,
    # A response given by at least this many pool candidates is a class label, not payload.
    "label_min": 5,
    # Word-sequence similarity (difflib ratio, or share of the item's words the pool text
    # contains in order) at or above which a pool candidate that shares a non-boilerplate
    # 4-gram with a benchmark item is its near-duplicate.
    "similarity": 0.9,
}

_WORD = re.compile(r"[a-z0-9]+")


def get_pool_module(name: str) -> ModuleType:
    """The module that builds pool `name` (one of POOL_NAMES)."""
    if name not in POOL_NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")


def make_record(rid: str, user: str, assistant: str, source: str,
                system: str | None = None) -> dict:
    """One pool example in the JSONL schema."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"id": rid, "messages": msgs, "source": source}


def zipf_counts(n: int, k: int, s: float) -> list[int]:
    """Split n into k counts proportional to 1/rank**s (largest remainders; sum is n)."""
    w = np.array([1.0 / (r ** s) for r in range(1, k + 1)])
    raw = n * w / w.sum()
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    return [int(c) for c in counts]


def words(text: str) -> list[str]:
    """Normalised words: lowercase runs of letters/digits (punctuation and case ignored)."""
    return _WORD.findall(text.lower())


def ngrams(ws: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """Set of word n-grams (empty if the text is shorter than n)."""
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def record_pair(rec: dict) -> tuple[str, str]:
    """A pool example as the model sees it: (rendered prompt, response)."""
    return render_example(rec["messages"])


def item_pair(item: dict) -> tuple[str, str]:
    """A benchmark item as (prompt, answer) or (prompt, correct choice)."""
    if "choices" in item:
        return item["prompt"], item["choices"][item["label"]]
    return item["prompt"], item["answer"]


@dataclass
class OverlapIndex:
    """Benchmark (prompt, answer) pairs indexed for the exact / 13-gram / Jaccard checks."""

    bench: Sequence[tuple[str, str]]
    ngram_n: int = 13
    boilerplate_df: float = 0.01
    boilerplate_min: int = 20
    min_content_words: int = 3
    label_min: int = 5
    similarity: float = 0.9

    @classmethod
    def from_cfg(cls, bench: Sequence[tuple[str, str]], cfg: dict) -> "OverlapIndex":
        return cls(bench, **{k: cfg.get(k, v) for k, v in OVERLAP_DEFAULTS.items()})

    def flag(self, pool: Sequence[tuple[str, str]]) -> list[str | None]:
        """For each pool pair: None if clean, else '<reason>:<benchmark index>'.

        Reasons: 'exact', 'ngram', 'similar'. Boilerplate statistics come from `pool`.
        """
        n = self.ngram_n
        pw = [(words(p), words(r)) for p, r in pool]
        bw = [(words(p), words(r)) for p, r in self.bench]
        label_count = Counter(" ".join(r) for _, r in pw)

        def core(p: list[str], r: list[str]) -> list[str]:
            return p if label_count[" ".join(r)] >= self.label_min else p + r

        pool_core = [core(p, r) for p, r in pw]
        bench_core = [core(p, r) for p, r in bw]
        thresh = max(self.boilerplate_min, math.ceil(self.boilerplate_df * len(pool)))
        pool_4g = [ngrams(ws, 4) for ws in pool_core]
        df_1 = Counter(w for ws in pool_core for w in set(ws))
        df_4 = Counter(g for s in pool_4g for g in s)
        exact = {}
        for i, (p, r) in enumerate(bw):
            exact.setdefault(" ".join(p + ["\x00"] + r), i)
        bench_ng: dict[tuple, int] = {}
        inv4: dict[tuple, list[int]] = {}
        for i, ws in enumerate(bench_core):
            for g in ngrams(ws, n):
                if sum(df_1[w] < thresh for w in g) >= self.min_content_words:
                    bench_ng.setdefault(g, i)
            for g in ngrams(ws, 4):
                if df_4[g] < thresh:
                    inv4.setdefault(g, []).append(i)
        def residual(ws: list[str]) -> list[str]:
            """The words not covered by any boilerplate 4-gram (template text removed)."""
            tpl = [False] * len(ws)
            for j in range(len(ws) - 3):
                if df_4[tuple(ws[j:j + 4])] >= thresh:
                    tpl[j:j + 4] = [True] * 4
            return [w for w, t in zip(ws, tpl) if not t]

        bench_res = [residual(ws) for ws in bench_core]
        out: list[str | None] = []
        for (p, r), ws, s4 in zip(pw, pool_core, pool_4g):
            key = " ".join(p + ["\x00"] + r)
            if key in exact:
                out.append(f"exact:{exact[key]}")
                continue
            hit = next((bench_ng[g] for g in ngrams(ws, n) if g in bench_ng), None)
            if hit is not None:
                out.append(f"ngram:{hit}")
                continue
            shared = Counter(i for g in s4 if df_4[g] < thresh for i in inv4.get(g, ()))
            reason = None
            res = residual(ws) if shared else []
            for i in sorted(shared):
                b = bench_res[i]
                sm = SequenceMatcher(None, res, b, autojunk=False)
                matched = sum(m.size for m in sm.get_matching_blocks())
                # Similar as a whole, or the pool text contains (nearly) all of the item.
                if (2 * matched >= self.similarity * (len(res) + len(b))
                        or (matched >= self.similarity * len(b) and (len(b) >= 2 or len(res) <= 3))):
                    reason = f"similar:{i}"
                    break
            out.append(reason)
        return out


def overlap_report(records: Sequence[dict], items: Sequence[dict], cfg: dict | None = None
                   ) -> list[tuple[int, str]]:
    """(record index, reason) for every pool record too close to a benchmark item."""
    index = OverlapIndex.from_cfg([item_pair(it) for it in items], cfg or {})
    flags = index.flag([record_pair(r) for r in records])
    return [(i, f) for i, f in enumerate(flags) if f is not None]


def filter_candidates(cands: Sequence[tuple[dict, str]], items: dict[str, list[dict]],
                      cfg: dict) -> tuple[list[tuple[dict, str]], Counter]:
    """Drop pool candidates too close to any benchmark item, and repeats within the pool.

    `cands` are (record, label) pairs in the order of preference; returns the kept ones in
    the same order and a count of the reasons for the dropped ones.
    """
    bench = [item_pair(it) for its in items.values() for it in its]
    pairs = [record_pair(r) for r, _ in cands]
    flags = OverlapIndex.from_cfg(bench, cfg).flag(pairs)
    dropped: Counter = Counter()
    seen: set[str] = set()
    kept = []
    for cand, (p, r), f in zip(cands, pairs, flags):
        key = " ".join(words(p)) + "\x00" + " ".join(words(r))
        if f is not None:
            dropped[f.split(":")[0]] += 1
        elif key in seen:
            dropped["pool_duplicate"] += 1
        else:
            seen.add(key)
            kept.append(cand)
    return kept, dropped


def select_pool(cands: Sequence[tuple[dict, str]], items: dict[str, list[dict]], cfg: dict,
                quota: int | dict[str, int]) -> tuple[list[tuple[dict, str]], Counter]:
    """Pick the pool from clean candidates, in order, up to `quota` (a total or per label).

    The overlap statistics (boilerplate, class labels) depend on the pool itself, so the
    check is repeated on the picked pool until it finds nothing: then `overlap_report` on
    the written files agrees. Returns the pool and the drop reasons.
    """
    clean, dropped = filter_candidates(cands, items, cfg)
    bench = [item_pair(it) for its in items.values() for it in its]
    index = OverlapIndex.from_cfg(bench, cfg)
    for _ in range(20):
        if isinstance(quota, int):
            chosen = list(clean[:quota])
        else:
            need = dict(quota)
            chosen = []
            for cand in clean:
                if need.get(cand[1], 0) > 0:
                    chosen.append(cand)
                    need[cand[1]] -= 1
        flags = index.flag([record_pair(r) for r, _ in chosen])
        bad = {id(c[0]) for c, f in zip(chosen, flags) if f is not None}
        if not bad:
            return chosen, dropped
        for f in flags:
            if f is not None:
                dropped[f.split(":")[0]] += 1
        clean = [c for c in clean if id(c[0]) not in bad]
    raise RuntimeError("the pool did not settle under the overlap check")


# ------------------------------------------------------------------- validation items

#: a stream of its own for the validation items: numpy.random.default_rng([seed, <the
#: module's stream>, VAL_STREAM]) (the test items and the pool use [seed, <stream>])
VAL_STREAM = 7


def val_count(cfg: Mapping, name: str = "") -> int:
    """The dataset's `val_per_task` (0 disables validation items); InputError unless an
    integer >= 0."""
    n = cfg.get("val_per_task", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"must be an integer >= 0, got {n!r}",
                         field=f"{name + '.' if name else ''}val_per_task")
    return n


def val_id(task: str, j: int) -> str:
    """Id of validation item j of a task: '<task>-val-0000' (never a test item's id)."""
    return f"{task}-val-{j:04d}"


def drop_overlapping(val_items: Mapping[str, Sequence[dict]], items: Mapping[str, Sequence[dict]],
                     cfg: Mapping, context: Sequence[dict] = ()
                     ) -> tuple[dict[str, list[dict]], dict[str, dict[str, int]]]:
    """Drop every validation item too close to a test item, under decontaminate's check.

    The check is the one the pools get (`OverlapIndex`: exact prompt + answer, a shared
    13-gram with content words, a near-duplicate), each validation item taken as the
    (prompt, gold answer or gold choice) pair it is trained / scored on. Its template and
    class-label statistics come from the examples it is checked with, so the validation
    items are checked together with `context` (the dataset's pool records), exactly as if
    they were pool examples: 16 items alone would make every shared template word
    "content". Repeated until nothing is flagged (the statistics move as items go), as
    `clusterft.stages.data.decontaminate` does. Returns (task -> kept items in order, task -> reason
    -> count dropped).
    """
    bench = [item_pair(it) for its in items.values() for it in its]
    alive = [(task, it) for task, its in val_items.items() for it in its]
    dropped: dict[str, Counter] = {task: Counter() for task in val_items}
    if bench and alive:
        index = OverlapIndex.from_cfg(bench, dict(cfg))
        ctx = [record_pair(r) for r in context]
        for _ in range(20):
            flags = index.flag(ctx + [item_pair(it) for _, it in alive])[len(ctx):]
            hits = [(t, f) for (t, _), f in zip(alive, flags) if f is not None]
            if not hits:
                break
            for task, f in hits:
                dropped[task][f.split(":")[0]] += 1
            alive = [a for a, f in zip(alive, flags) if f is None]
        else:
            raise RuntimeError("the validation items did not settle under the overlap check")
    kept: dict[str, list[dict]] = {task: [] for task in val_items}
    for task, it in alive:
        kept[task].append(it)
    return kept, {t: dict(sorted(c.items())) for t, c in dropped.items()}


@dataclass
class Built:
    """What a pool module hands back: the pool, its labels, the benchmark (test) items and
    the validation items (task -> items, empty when val_per_task is 0; not yet checked
    against the test items: `drop_overlapping`)."""

    records: list[dict]
    labels: list[str]
    items: dict[str, list[dict]]
    dropped: dict[str, int] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    val_items: dict[str, list[dict]] = field(default_factory=dict)


def built_pool(name: str, chosen: Sequence[tuple[dict, str]], items: dict[str, list[dict]],
               dropped: Mapping[str, int], extra: dict, min_examples: int | None = None,
               val_items: dict[str, list[dict]] | None = None) -> Built:
    """Number the chosen (record, label) pairs and package them; with `min_examples`, too few
    left after the caps and overlap checks is an error naming `<name>.min_examples`."""
    if min_examples is not None and len(chosen) < int(min_examples):
        raise InputError(f"only {len(chosen)} {name} examples remain after the caps and the "
                         f"overlap checks (min_examples = {min_examples}); lower "
                         "min_examples or loosen the caps", field=f"{name}.min_examples")
    return Built(records=assign_ids(name, [r for r, _ in chosen]),
                 labels=[lab for _, lab in chosen], items=items, dropped=dict(dropped),
                 extra=extra, val_items=dict(val_items or {}))


def assign_ids(prefix: str, records: Iterable[dict]) -> list[dict]:
    """Give records ids `<prefix>-00000`, ... in their order."""
    out = []
    for i, r in enumerate(records):
        r = dict(r)
        r["id"] = f"{prefix}-{i:05d}"
        out.append(r)
    return out
