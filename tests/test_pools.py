"""Pool properties: sizes, Zipf skew, topic/skill independence, labels, determinism."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from clusterft.pipeline import provenance
from clusterft.stages.data.prepare import run_prepare_data
from clusterft.pools.poolfile import load_pool
from clusterft.pipeline.errors import InputError
from clusterft.pools import icd10, pycode, skills, stdlib_snapshot, zipf_counts
from clusterft.modeling.prompt import render_prompt

from conftest import PREPARED_SIZES

SMALL = PREPARED_SIZES


@pytest.fixture(scope="module")
def prepared(prepared_root):
    """The three datasets prepared once (default benchmark sizes), seed 0."""
    root, summaries = prepared_root
    out = {}
    for ds in SMALL:
        d = root / ds
        out[ds] = {"dir": d, "summary": summaries[ds], "pool": load_pool(d / "pool.jsonl"),
                   "labels": pd.read_parquet(d / "labels.parquet")}
    out["bench"] = root / "bench"
    return out


def test_sizes_and_labels_aligned(prepared):
    for ds, cfg in SMALL.items():
        pool, labels = prepared[ds]["pool"], prepared[ds]["labels"]
        assert len(pool) == cfg["n"]
        assert list(labels.columns) == ["id", "label"]
        assert list(labels["id"]) == [r["id"] for r in pool]
        assert len(set(labels["id"])) == len(pool)
        assert prepared[ds]["summary"]["label_counts"] == dict(Counter(labels["label"]))
        # The label is never stored in the pool records the method reads.
        for r in pool[:50]:
            assert set(r) == {"id", "messages", "source"}


def test_pool_default_size_in_range():
    for mod in (skills, pycode, icd10):
        assert 2000 <= mod.DEFAULTS["n"] <= 10000


def test_zipf_counts():
    c = zipf_counts(3000, 10, 1.4)
    assert sum(c) == 3000 and c == sorted(c, reverse=True)
    assert min(c) / 3000 <= 0.02
    assert zipf_counts(7, 3, 1.0) == [4, 2, 1]


def test_skills_zipf_skew(prepared):
    counts = Counter(prepared["skills"]["labels"]["label"])
    n = len(prepared["skills"]["pool"])
    assert set(counts) == set(skills.SKILLS) and len(counts) >= 8
    assert min(counts.values()) / n <= 0.02
    assert max(counts.values()) / n >= 0.3
    assert [counts[s] for s in skills.SKILLS] == zipf_counts(n, len(skills.SKILLS),
                                                             skills.DEFAULTS["zipf_s"])


def _topic_of(user: str) -> str:
    ws = set(re.findall(r"[a-z]+", user.lower()))
    hits = [t for t, vocab in skills.TOPICS.items() if ws & set(vocab)]
    assert len(hits) == 1, user
    return hits[0]


def test_skills_topics_independent_of_skill(prepared):
    pool, labels = prepared["skills"]["pool"], list(prepared["skills"]["labels"]["label"])
    pairs = Counter((lab, _topic_of(r["messages"][0]["content"])) for r, lab in zip(pool, labels))
    topics = sorted(skills.TOPICS)
    table = np.array([[pairs[(s, t)] for t in topics] for s in skills.SKILLS], dtype=float)
    assert (table > 0).all(), "every topic co-occurs with every skill"
    # Chi-square test of independence at the 0.1% level.
    from scipy.stats import chi2 as chi2_dist
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    assert chi2 < chi2_dist.ppf(0.999, dof), chi2


def test_skills_vocabulary_disjoint_from_templates():
    tpl_words = {w for ts in skills.TEMPLATES.values() for t in ts
                 for w in re.findall(r"[a-z]+", t.lower())}
    vocab = [w for v in skills.TOPICS.values() for w in v]
    assert len(vocab) == len(set(vocab)), "topics share no word"
    assert not tpl_words & set(vocab)


@pytest.mark.parametrize("skill", skills.SKILLS)
def test_skills_answers_are_correct(skill):
    rng = np.random.default_rng(5)
    for _ in range(30):
        ex = skills.generate(skill, "data", rng, skills.DEFAULTS)
        ws, ans = ex["words"], ex["answer"]
        expect = {
            "repeat": lambda: " ".join(ws),
            "reverse": lambda: " ".join(ws[::-1]),
            "sort": lambda: " ".join(sorted(ws)),
            "first_k": lambda: " ".join(ws[:ex["k"]]),
            "last_k": lambda: " ".join(ws[-ex["k"]:]),
            "join_commas": lambda: ", ".join(ws),
            "dedupe": lambda: " ".join(dict.fromkeys(ws)),
            "drop_word": lambda: " ".join(w for w in ws if w != ex["x"]),
            "count_words": lambda: str(len(ws)),
            "count_occurrences": lambda: str(ws.count(ex["x"])),
            "position": lambda: str(ws.index(ex["x"]) + 1),
        }[skill]()
        assert ans == expect, (skill, ex)
        assert " ".join(ws) in ex["user"]


def test_skills_responses_start_with_space(prepared):
    for r in prepared["skills"]["pool"]:
        c = r["messages"][-1]["content"]
        assert c.startswith(" ") and not c.startswith("  ") and "\n" not in c


def test_pycode_pool(prepared):
    pool, labels = prepared["pycode"]["pool"], prepared["pycode"]["labels"]
    for r in pool:
        user, body = r["messages"][0]["content"], r["messages"][1]["content"]
        assert re.match(r"(async )?def \w+\(.*\).*:\n    \"\"\".+\"\"\"$", user, re.S), user
        assert body.startswith("    ") and len(body) <= pycode.DEFAULTS["max_body_chars"]
        assert len(user) + len(body) <= pycode.DEFAULTS["max_chars"]
        head = "async def f():\n" if user.startswith("async ") else "def f():\n"
        if "nonlocal" not in body:  # nonlocal needs the enclosing function's names
            compile(head + body + "\n", "<body>", "exec", dont_inherit=True)
    keys = [" ".join((r["messages"][0]["content"].split("\n", 1)[1] + r["messages"][1]["content"]).split())
            for r in pool]
    assert len(set(keys)) == len(keys), "deduplicated"
    assert labels["label"].nunique() > 50
    pool_files = {r["source"].split("/", 1)[1] for r in pool}
    _, corpus_files = pycode.stdlib_split(pycode.DEFAULTS["corpus_fraction"])
    assert pool_files and not pool_files & set(corpus_files)
    assert prepared["pycode"]["summary"]["extra"]["stdlib_snapshot"] == stdlib_snapshot.info()
    assert not any(re.search(r"(^|/)(test|tests|idlelib|site-packages)/", f) for f in pool_files)


def test_pycode_min_examples_error():
    with pytest.raises(InputError) as ei:
        pycode.build({**pycode.DEFAULTS, "min_examples": 100000}, seed=0)
    assert ei.value.field == "pycode.min_examples"


def test_pycode_rename_params():
    body = "    x = foo(a, b=a)\n    return self.a + a  # a"
    assert pycode.rename_params(body, {"a": "zz"}) == "    x = foo(zz, b=zz)\n    return self.a + zz  # a"
    assert pycode.rename_params(body, {"q": "zz"}) is None


def test_icd10_pool(prepared):
    pool, labels = prepared["icd10"]["pool"], prepared["icd10"]["labels"]
    tree = icd10.load_tree(None)
    chapters = {ch for ch, _ in tree.chapters}
    assert set(labels["label"]) <= chapters and labels["label"].nunique() >= 20
    kinds = Counter(r["source"].split("/")[1] for r in pool)
    assert set(kinds) == set(icd10.TEMPLATES)
    by_code = {c.code: c for c in tree.codes}
    for r, lab in zip(pool[:300], labels["label"][:300]):
        user, ans = r["messages"][0]["content"], r["messages"][1]["content"]
        m = re.search(r"[Cc]ode ([A-Z]\d\d(?:\.\d+)?)", user)
        if m:
            c = by_code[m.group(1)]
            assert c.chapter == lab
            assert ans in (c.chapter, c.block, c.desc)


def test_icd10_tree():
    tree = icd10.load_tree(None)
    assert len(tree.chapters) == 22 and len(tree.blocks) > 200 and len(tree.codes) > 10000
    c = {x.code: x for x in tree.codes}["A01.1"]
    assert (c.desc, c.chapter, c.block) == ("Paratyphoid fever A", "I", "A00-A09")
    with pytest.raises(InputError):
        icd10.load_tree("/nonexistent/icd.xml")


def _bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not provenance.is_sidecar(p)}  # sidecars name paths and times


@pytest.mark.parametrize("ds, cfg", [("skills", {"n": 400, "items_per_task": 30}),
                                     ("icd10", {"n": 400, "items_per_task": 30,
                                                "min_examples": 100}),
                                     ("pycode", {"n": 400, "items_per_task": 30,
                                                 "min_examples": 100})])
def test_determinism_by_seed(tmp_path, ds, cfg):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run_prepare_data(ds, cfg, tmp_path / name / "pool.jsonl",
                         tmp_path / name / "labels.parquet", tmp_path / name / "bench", seed)
    a, b, c = (_bytes(tmp_path / x) for x in "abc")
    assert a == b, "same seed -> byte-identical files"
    assert set(a) == set(c)
    assert a["pool.jsonl"] != c["pool.jsonl"]
    bench = [k for k in a if k not in ("pool.jsonl", "labels.parquet")]
    assert bench and all(a[k] != c[k] for k in bench), "different seed -> different items"


def test_prompts_render_like_training(prepared):
    r = prepared["skills"]["pool"][0]
    assert render_prompt(r["messages"]).endswith("### Response:\n")


@pytest.mark.parametrize("ds, cfg", [("skills", {"n": 300, "items_per_task": 30}),
                                     ("icd10", {"n": 300, "items_per_task": 30,
                                                "min_examples": 100}),
                                     ("pycode", {"n": 300, "items_per_task": 30,
                                                 "min_examples": 100})])
def test_val_items_leave_test_items_and_pool_unchanged(tmp_path, ds, cfg):
    """The validation items come from a stream of their own and held-out inputs only: the
    pool, its labels and every test item file are the same bytes with val_per_task 0 (no
    validation items) and with validation items."""
    from clusterft.tasks.registry import tasks_for_dataset, val_file

    runs = {}
    for name, val in (("none", 0), ("some", 16), ("more", 24)):
        d = tmp_path / name
        runs[name] = run_prepare_data(ds, {**cfg, "val_per_task": val}, d / "pool.jsonl",
                                      d / "labels.parquet", d / "bench", seed=0)
    files = {name: _bytes(tmp_path / name) for name in runs}
    tasks = tasks_for_dataset(ds)
    assert sorted(files["none"]) == sorted(["pool.jsonl", "labels.parquet",
                                            *(f"{t}.jsonl" for t in tasks)])
    assert not runs["none"]["val"]
    for name in ("some", "more"):
        assert sorted(files[name]) == sorted([*files["none"],
                                              *(val_file("", t).name for t in tasks)])
        assert {k: files[name][k] for k in files["none"]} == files["none"]
        assert runs[name]["tasks"] == runs["none"]["tasks"]
        assert runs[name]["n"] == runs["none"]["n"]
        assert set(runs[name]["val"]) == set(tasks) == set(runs[name]["val_dropped"])
    # and no validation prompt is a test prompt
    import json

    for t in tasks:
        test = {json.loads(x)["prompt"] for x in files["none"][f"{t}.jsonl"].splitlines()}
        val = [json.loads(x)["prompt"] for x in files["some"][val_file("", t).name].splitlines()]
        assert val and not test & set(val)
