"""The general corpus: local sources, size, and disjointness from pools and benchmarks."""

from __future__ import annotations

import json

import pytest

from clusterft.stages.data.corpus import (DEFAULTS, Excluder, corpus_overlaps, exclude_texts, merge_cfg,
                              run_corpus)
from clusterft.stages.data.prepare import run_prepare_data
from clusterft.pipeline.errors import InputError
from clusterft.pools import icd10, ngrams, stdlib_snapshot, words

SMALL = {"skills": {"n": 500, "items_per_task": 60},
         "pycode": {"n": 2100, "items_per_task": 60},
         "icd10": {"n": 2000, "items_per_task": 60, "min_examples": 500}}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    paths = []
    for ds, cfg in SMALL.items():
        run_prepare_data(ds, cfg, root / ds / "pool.jsonl", root / ds / "labels.parquet",
                         root / "bench", seed=0)
        paths.append(str(root / ds / "pool.jsonl"))
    paths += sorted(str(p) for p in (root / "bench").glob("*.jsonl"))
    out = root / "corpus.txt"
    summary = run_corpus({}, out, paths, seed=0, out_summary=root / "corpus.json")
    return {"root": root, "paths": paths, "text": out.read_text(encoding="utf-8"),
            "summary": summary}


def test_corpus_size_and_format(built):
    text, s = built["text"], built["summary"]
    assert 800_000 <= len(text) <= DEFAULTS["max_chars"] + 10
    docs = [d for d in text.split("\n\n\n") if d.strip()]
    assert len(docs) == s["documents"] > 50
    assert all("\n\n\n" not in d for d in docs)
    written = json.loads((built["root"] / "corpus.json").read_text())
    assert written["stdlib_snapshot"] == s["stdlib_snapshot"] == stdlib_snapshot.info()
    # English prose, Python code and medical vocabulary are all there.
    assert "def " in text and "return" in text
    assert "statement" in text and "fracture" in text.lower()


def test_corpus_disjoint_from_pools_and_benchmarks(built):
    texts = exclude_texts(built["paths"])
    assert len(texts) > 5000
    # No corpus line shares a 13-gram with any pool / benchmark text ...
    assert corpus_overlaps(built["text"], texts) == []
    # ... nor does any 13-word window across the lines of a document.
    grams = set()
    for t in texts:
        grams |= ngrams(words(t), 13)
    for doc in built["text"].split("\n\n\n"):
        assert not ngrams(words(doc), 13) & grams
    # No pool/benchmark ICD-10 description or long line appears as a corpus line.
    lines = {" ".join(words(ln)) for t in texts for ln in t.split("\n")}
    descs = {" ".join(words(c.desc)) for c in icd10.load_tree(None).codes}
    for ln in built["text"].split("\n"):
        w = " ".join(words(ln))
        if w in lines:
            assert w not in descs and len(w.split()) < DEFAULTS["min_exact_words"], ln


def test_corpus_excludes_pycode_files(built):
    from clusterft.pools.poolfile import load_pool
    pool = load_pool(built["root"] / "pycode" / "pool.jsonl")
    files = {r["source"].split("/", 1)[1] for r in pool}
    headers = {ln[len("# file: "):] for ln in built["text"].split("\n") if ln.startswith("# file: ")}
    assert headers and not headers & files


def test_planted_overlap_is_dropped(built, tmp_path):
    """A line of the corpus, planted into an excluded file, disappears from the next corpus."""
    text = built["text"]
    line = next(ln for ln in text.split("\n") if len(words(ln)) >= 16 and not ln.startswith("#"))
    short_desc = "Acute tracheitis"
    planted = tmp_path / "planted.jsonl"
    planted.write_text(json.dumps({"id": "p", "prompt": "x", "answer": line}) + "\n" +
                       json.dumps({"id": "q", "prompt": "y\n" + short_desc, "answer": "I"}) + "\n",
                       encoding="utf-8")
    out = tmp_path / "c.txt"
    run_corpus({}, out, [str(planted)], seed=0)
    new = out.read_text(encoding="utf-8")
    assert line in text and line not in new
    assert short_desc not in new.split("\n")


def test_excluder_window_across_lines():
    ex = Excluder(["one two three four five six seven eight nine ten eleven twelve thirteen"])
    kept, why = ex.filter_doc(["zero one two three four five six", "seven eight nine ten",
                               "eleven twelve thirteen fourteen", "other line"])
    assert kept == ["other line"] and why["ngram"] == 3


def test_corpus_determinism_and_errors(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    cfg = {"topics_chars": 50_000, "stdlib_chars": 100_000, "icd10_chars": 20_000}
    run_corpus(cfg, a, [], seed=0)
    run_corpus(cfg, b, [], seed=0)
    assert a.read_bytes() == b.read_bytes()
    run_corpus(cfg, b, [], seed=1)
    assert a.read_bytes() != b.read_bytes()
    with pytest.raises(InputError):
        merge_cfg({"size": 3})
    with pytest.raises(InputError, match="does not exist"):
        run_corpus({}, tmp_path / "c.txt", [str(tmp_path / "missing.jsonl")])


def test_skills_words_are_single_tokens_of_a_corpus_bpe(built):
    """The skills vocabulary is 'token level' for a 2048-token BPE trained on this corpus."""
    from clusterft.stages.models import train_tokenizer
    from clusterft.pools import skills

    lines = built["text"].splitlines(keepends=True)
    tok = train_tokenizer(lines, 2048, None, seed=0)
    vocab = [w for v in skills.TOPICS.values() for w in v]
    multi = [w for w in vocab if len(tok(" " + w, add_special_tokens=False)["input_ids"]) > 1]
    assert len(multi) <= len(vocab) // 20, multi
