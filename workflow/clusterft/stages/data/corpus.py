"""General corpus for the tokenizer and base-model pretraining, disjoint from pools/benchmarks.

Built locally, no downloads, from three sources:
- ``pydoc_data/topics.py``: the Python language reference as plain English text (+ small
  code examples);
- the CORPUS part of the stdlib source files (`pools.pycode.stdlib_split`): code, docstrings
  and comments of modules the pycode pool never reads (character-map tables of the
  `encodings` package are skipped);
- ICD-10 descriptions and block titles as shuffled lines with NO hierarchy (no codes,
  chapters or blocks next to them), so the model sees the medical vocabulary without the
  mappings the benchmarks test.
The first two come from the stdlib snapshot shipped in the package (`pools.stdlib_snapshot`:
CPython 3.11.7's files, checked against recorded sha256s before anything is built), not
from the running interpreter.

Disjointness: every line that shares a word 13-gram with any text of the `exclude` files
(pool messages, benchmark prompts, answers and choices; windows may span lines of a
document, then every line they touch is dropped) is removed, as is every line whose
normalised text equals a line of those texts (lines of >= `min_exact_words` words; any
length for the ICD-10 lines). Documents are separated by two blank lines (the format
`clusterft.stages.models.read_corpus` splits on).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from clusterft.pipeline.sections import merge_section
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_jsonl, write_json, write_text
from clusterft.pipeline.pace import Pace
from clusterft.pools import ngrams, stdlib_snapshot, words
from clusterft.pools import pycode as pycode_pool

DEFAULTS: dict[str, Any] = {
    # Upper bound on the corpus size (characters, after filtering).
    "max_chars": 2_000_000,
    # Characters taken from the Python language reference (pydoc_data.topics).
    "topics_chars": 450_000,
    # Characters taken from the corpus part of the stdlib source ...
    "stdlib_chars": 1_250_000,
    # ... at most this many from any one file (so many modules contribute).
    "stdlib_file_chars": 30_000,
    # Characters of ICD-10 description / block-title lines.
    "icd10_chars": 300_000,
    # Lines of ICD-10 text per corpus document.
    "icd10_lines_per_doc": 40,
    # Must equal datasets.pycode.corpus_fraction: the share of stdlib files given to the corpus.
    "stdlib_corpus_fraction": pycode_pool.DEFAULTS["corpus_fraction"],
    # Word n-gram length of the overlap filter.
    "ngram_n": 13,
    # A corpus line equal (normalised) to a line of the excluded texts is dropped when it has
    # at least this many words (short lines such as "return x" are everywhere).
    "min_exact_words": 4,
}

SKIP_PACKAGES = ("encodings/",)


def merge_cfg(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """DEFAULTS overridden by cfg; unknown keys raise InputError."""
    return merge_section(DEFAULTS, cfg, "corpus")


# ------------------------------------------------------------------ excluded texts

def exclude_texts(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Every text of pool / benchmark JSONL files: message contents, prompts, answers, choices."""
    out: list[str] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise InputError("exclude file does not exist", path=str(p))
        for rec in read_jsonl(p):
            for m in rec.get("messages", []) or []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    out.append(m["content"])
            for key in ("prompt", "answer"):
                if isinstance(rec.get(key), str):
                    out.append(rec[key])
            out.extend(c for c in rec.get("choices", []) or [] if isinstance(c, str))
    return out


class Excluder:
    """13-gram and exact-line lookups over the excluded texts."""

    def __init__(self, texts: Iterable[str], n: int = 13, min_exact_words: int = 4) -> None:
        self.n, self.min_exact_words = n, min_exact_words
        self.grams: set[tuple[str, ...]] = set()
        self.lines: set[str] = set()
        for t in texts:
            self.grams |= ngrams(words(t), n)
            for ln in t.split("\n"):
                w = words(ln)
                if w:
                    self.lines.add(" ".join(w))

    def filter_doc(self, lines: list[str], exact_min: int | None = None) -> tuple[list[str], Counter]:
        """Keep the lines of one document that share no n-gram / exact line with the texts.

        Dropping lines joins their neighbours, which can form a new matching window, so the
        filter repeats until nothing changes.
        """
        total: Counter = Counter()
        while True:
            kept, why = self._filter_once(lines, exact_min)
            total.update(why)
            if len(kept) == len(lines):
                return kept, total
            lines = kept

    def _filter_once(self, lines: list[str], exact_min: int | None) -> tuple[list[str], Counter]:
        exact_min = self.min_exact_words if exact_min is None else exact_min
        seq: list[tuple[str, int]] = []
        for i, ln in enumerate(lines):
            seq.extend((w, i) for w in words(ln))
        bad: set[int] = set()
        n = self.n
        for j in range(len(seq) - n + 1):
            if tuple(w for w, _ in seq[j:j + n]) in self.grams:
                bad.update(range(seq[j][1], seq[j + n - 1][1] + 1))
        why = Counter(ngram=len(bad))
        for i, ln in enumerate(lines):
            w = words(ln)
            if i not in bad and len(w) >= exact_min and " ".join(w) in self.lines:
                bad.add(i)
                why["exact_line"] += 1
        return [ln for i, ln in enumerate(lines) if i not in bad], why


# ------------------------------------------------------------------------- sources

def _clean(text: str) -> list[str]:
    """Lines without trailing spaces and without runs of blank lines (documents stay whole)."""
    out: list[str] = []
    for ln in text.replace("\r\n", "\n").split("\n"):
        ln = ln.rstrip()
        if ln or (out and out[-1]):
            out.append(ln)
    while out and not out[-1]:
        out.pop()
    return out


def topics_docs(max_chars: int) -> list[list[str]]:
    """The Python language reference topics, one document each (sorted by topic name).

    From the snapshot's ``pydoc_data/topics.py`` (parsed, not imported or executed).
    """
    topics = stdlib_snapshot.topics()
    docs, total = [], 0
    for name in sorted(topics):
        lines = _clean(topics[name])
        size = sum(len(x) + 1 for x in lines)
        if total + size > max_chars:
            break
        docs.append(lines)
        total += size
    return docs


def stdlib_docs(cfg: dict, root: Path | None = None) -> list[list[str]]:
    """Source of the corpus part of the stdlib, one document per file (capped per file).

    From the pinned snapshot, or from the stdlib folder `root` if given.
    """
    _, files = pycode_pool.stdlib_split(cfg["stdlib_corpus_fraction"], root)
    docs, total = [], 0
    for rel in files:
        if rel.startswith(SKIP_PACKAGES):
            continue
        text = pycode_pool.read_source(rel, root)
        if text is None:
            continue
        text = text[: int(cfg["stdlib_file_chars"])]
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
        lines = _clean(f"# file: {rel}\n" + text)
        size = sum(len(x) + 1 for x in lines)
        if total + size > cfg["stdlib_chars"]:
            continue
        docs.append(lines)
        total += size
    return docs


def icd10_lines(rng: np.random.Generator) -> list[str]:
    """ICD-10 descriptions and block titles, deduplicated and shuffled (no hierarchy)."""
    from clusterft.pools import icd10

    tree = icd10.load_tree(None)
    lines = sorted({c.desc for c in tree.codes if icd10.informative(c)}
                   | {t for _, t in tree.blocks})
    return [lines[int(i)] for i in rng.permutation(len(lines))]


# ------------------------------------------------------------------------ assemble

def build_corpus(cfg: dict, excluder: Excluder, seed: int = 0) -> tuple[list[str], dict]:
    """Documents (strings) of the corpus and a summary of what was dropped."""
    rng = np.random.default_rng([seed, 404])
    stats: dict[str, Counter] = {}
    docs: list[str] = []
    sources = {"topics": topics_docs(int(cfg["topics_chars"])), "stdlib": stdlib_docs(cfg)}
    for name, src_docs in sources.items():
        st = stats.setdefault(name, Counter())
        # a bar on a terminal, plain pace lines in the rule's log (clusterft.pipeline.pace)
        with Pace(len(src_docs), f"corpus {name}", unit="document",
                  disable=len(src_docs) < 2) as pace:
            for lines in src_docs:
                kept, why = excluder.filter_doc(lines)
                st.update(why)
                kept = _clean("\n".join(kept))
                if kept:
                    docs.append("\n".join(kept))
                pace.update()
    st = stats.setdefault("icd10", Counter())
    per, size = int(cfg["icd10_lines_per_doc"]), 0
    lines = icd10_lines(rng)
    for i in range(0, len(lines), per):
        kept, why = excluder.filter_doc(lines[i:i + per], exact_min=1)
        st.update(why)
        chunk = "\n".join(kept)
        if kept and size + len(chunk) + 3 <= cfg["icd10_chars"]:
            docs.append(chunk)
            size += len(chunk) + 3
    docs = [docs[int(i)] for i in rng.permutation(len(docs))]
    out, total = [], 0
    for d in docs:
        if total + len(d) + 3 > cfg["max_chars"]:
            continue
        out.append(d)
        total += len(d) + 3
    summary = {"documents": len(out), "chars": total,
               "dropped_lines": {k: dict(v) for k, v in stats.items()}}
    return out, summary


def run_corpus(cfg: Mapping[str, Any] | None, out_txt: str | os.PathLike,
               exclude_texts_paths: list[str] | None = None, seed: int = 0,
               out_summary: str | os.PathLike | None = None) -> dict:
    """Stage `corpus`: write the corpus text file; lines overlapping the excluded files are dropped."""
    c = merge_cfg(cfg)
    snapshot = stdlib_snapshot.info()  # checked before the expensive work
    excluder = Excluder(exclude_texts(exclude_texts_paths or []), int(c["ngram_n"]),
                        int(c["min_exact_words"]))
    docs, summary = build_corpus(c, excluder, seed)
    if not docs:
        raise InputError("the corpus came out empty; check the corpus config", field="corpus")
    write_text(out_txt, "\n\n\n".join(docs) + "\n")
    summary["excluded_files"] = [str(p) for p in exclude_texts_paths or []]
    summary["stdlib_snapshot"] = snapshot
    if out_summary is not None:
        write_json(out_summary, summary)
    return summary


def corpus_overlaps(corpus_text: str, texts: Iterable[str], n: int = 13) -> list[str]:
    """Lines of a corpus that share a word n-gram (within the line) with any of `texts`."""
    grams: set = set()
    for t in texts:
        grams |= ngrams(words(t), n)
    return [ln for ln in corpus_text.split("\n") if ngrams(words(ln), n) & grams]


__all__ = ["DEFAULTS", "run_corpus", "build_corpus", "exclude_texts", "Excluder",
           "corpus_overlaps", "merge_cfg"]
