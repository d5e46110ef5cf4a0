"""Benchmark registry and items: formats, sizes, balance, and no item (or near-duplicate) in a pool."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from clusterft.tasks.registry import (DOMAINS, TASKS, TaskSpec, check_item, tasks_for_dataset,
                                  tasks_for_domain)
from clusterft.pools.poolfile import load_pool
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_jsonl
from clusterft.pools import (OverlapIndex, icd10, item_pair, make_record, overlap_report,
                             record_pair, skills, words)
from clusterft.modeling.prompt import RESPONSE, render_prompt

from conftest import PREPARED_SIZES



@pytest.fixture(scope="module")
def prepared(prepared_root):
    root, _ = prepared_root
    pools = {ds: load_pool(root / ds / "pool.jsonl") for ds in PREPARED_SIZES}
    items = {t: read_jsonl(root / "bench" / f"{t}.jsonl") for t in TASKS}
    return {"pools": pools, "items": items}


def test_registry():
    assert len(TASKS) == 9  # the paper's 8 benchmarks' stand-ins and the testbed's task
    for name, t in TASKS.items():
        assert isinstance(t, TaskSpec) and t.name == name
        assert t.domain in DOMAINS and t.dataset in ("skills", "pycode", "icd10", "cipher")
        assert t.output_type in ("multiple_choice", "generate_until")
        if t.output_type == "multiple_choice":
            assert t.chance == pytest.approx(0.25) and t.metric == "acc"
        else:
            assert 0 <= t.chance <= 0.15 and t.metric == "exact_match"
        assert t.description
    for d in DOMAINS:
        assert len(tasks_for_domain(d)) >= 3
    assert {TASKS[t].output_type for t in TASKS} == {"multiple_choice", "generate_until"}
    assert sum(len(tasks_for_dataset(d)) for d in ("skills", "pycode", "icd10", "cipher")) == 9
    assert tasks_for_dataset("mine") == []
    with pytest.raises(InputError):
        tasks_for_domain("law")


def test_items_format_and_size(prepared):
    for name, items in prepared["items"].items():
        spec = TASKS[name]
        assert len(items) >= 200
        assert len({it["id"] for it in items}) == len(items)
        for j, it in enumerate(items, start=1):
            check_item(it, spec, name, j)
            assert it["prompt"].startswith("### Instruction:\n") and it["prompt"].endswith(RESPONSE)
        if spec.output_type == "multiple_choice":
            assert {len(it["choices"]) for it in items} == {4}
            # The right answer sits at every position about equally often.
            pos = Counter(it["label"] for it in items)
            assert set(pos) == {0, 1, 2, 3} and min(pos.values()) >= 30
            # Choices are continuations written like pool responses.
            for it in items:
                assert all(not c.startswith("\n") for c in it["choices"])


def test_items_are_short(prepared):
    for name, items in prepared["items"].items():
        for it in items:
            _, ans = item_pair(it)
            # ~3 characters per BPE token: most prompts+answers well under ~100-190 tokens.
            limit = 620 if name.startswith("pycode") else 400
            assert len(it["prompt"]) + len(ans) < limit, (name, it["id"])


def test_skills_items_balanced_and_correct(prepared):
    for task, sk in skills.TASK_SKILLS.items():
        items = prepared["items"][task]
        groups = Counter(it["group"] for it in items)
        assert set(groups) == set(sk)
        assert max(groups.values()) - min(groups.values()) <= 1
    mc = prepared["items"]["skills_mc"]
    for it in mc:
        assert all(c.startswith(" ") for c in it["choices"])
    gen = prepared["items"]["skills_words"]
    for it in gen:
        user = it["prompt"][len("### Instruction:\n"):-len(RESPONSE)]
        ws = user.split(": ", 1)[1].split()
        if it["group"] == "reverse":
            assert it["answer"] == " ".join(ws[::-1])
        if it["group"] == "sort":
            assert it["answer"] == " ".join(sorted(ws))


def test_icd10_items(prepared):
    tree = icd10.load_tree(None)
    by_desc = {c.desc: c for c in tree.codes}
    for task in ("icd10_chapter_mc", "icd10_block_mc", "icd10_code_chapter"):
        groups = Counter(it["group"] for it in prepared["items"][task])
        assert len(groups) == 21 and "XXII" not in groups
    for it in prepared["items"]["icd10_chapter_mc"]:
        desc = it["prompt"].split("\n")[2]
        assert it["choices"][it["label"]] == by_desc[desc].chapter_title
    for it in prepared["items"]["icd10_block_mc"]:
        desc = it["prompt"].split("\n")[2]
        assert it["choices"][it["label"]] == by_desc[desc].block_title


def _norm(s: str) -> str:
    return " ".join(words(s))


def test_no_exact_item_in_any_pool(prepared):
    """Independent of the builders' check: normalised prompt+answer never equals a pool example."""
    pool_texts = {_norm("".join(record_pair(r))) for p in prepared["pools"].values() for r in p}
    pool_users = {_norm(r["messages"][0]["content"]) for p in prepared["pools"].values() for r in p}
    for name, items in prepared["items"].items():
        for it in items:
            p, a = item_pair(it)
            assert _norm(p + a) not in pool_texts, (name, it["id"])
            user = p[len("### Instruction:\n"):-len(RESPONSE)]
            assert _norm(user) not in pool_users, (name, it["id"])


def test_no_near_duplicate_in_any_pool(prepared):
    for name, items in prepared["items"].items():
        pool = prepared["pools"][TASKS[name].dataset]
        assert overlap_report(pool, items) == []


def test_skills_inputs_held_out(prepared):
    def wordset(user: str) -> frozenset:
        return frozenset(re.split(r"[:?] ", user, maxsplit=1)[1].split())
    pool = {wordset(r["messages"][0]["content"]) for r in prepared["pools"]["skills"]}
    for task in skills.TASK_SKILLS:
        for it in prepared["items"][task]:
            user = it["prompt"][len("### Instruction:\n"):-len(RESPONSE)]
            assert wordset(user) not in pool


def test_icd10_categories_held_out(prepared):
    """No pool example mentions a held-out category's code or any of its descriptions."""
    tree = icd10.load_tree(None)
    by_desc = {c.desc: c for c in tree.codes}
    held = set()
    for it in prepared["items"]["icd10_code_chapter"]:
        held.add(re.search(r"[Cc]ode ([A-Z]\d\d)", it["prompt"]).group(1))
    for task in ("icd10_chapter_mc", "icd10_block_mc"):
        for it in prepared["items"][task]:
            held.add(by_desc[it["prompt"].split("\n")[2]].code.split(".")[0])
    # Descriptions of held-out codes (those unique in ICD-10: "During injection or
    # immunization" is shared by Y60.3, Y61.3 and Y62.3, which may be in the pool).
    n_desc = Counter(c.desc for c in tree.codes)
    held_desc = {c.desc for c in tree.codes if c.code.split(".")[0] in held and n_desc[c.desc] == 1}
    titles = {t for _, t in tree.blocks} | {t for _, t in tree.chapters}
    for r in prepared["pools"]["icd10"]:
        text = r["messages"][0]["content"] + "\n" + r["messages"][1]["content"]
        # Codes, not the ends of block ranges ("Q10-Q18").
        for code in re.findall(r"(?<![-\w])([A-Z]\d\d)(?:\.\d)?(?![-\w])", text):
            assert code not in held, text
        for line in r["messages"][0]["content"].split("\n"):
            assert line not in held_desc, text
        # A response may be a block title that happens to equal a category's description.
        if r["messages"][1]["content"] not in titles:
            assert r["messages"][1]["content"] not in held_desc, text


def test_pycode_functions_held_out(prepared):
    pool_users = {r["messages"][0]["content"] for r in prepared["pools"]["pycode"]}
    pool_bodies = {r["messages"][1]["content"] for r in prepared["pools"]["pycode"]}
    for task in ("pycode_body_mc", "pycode_args_mc"):
        for it in prepared["items"][task]:
            user = it["prompt"][len("### Instruction:\n"):-len(RESPONSE)]
            assert user not in pool_users
            assert it["choices"][it["label"]] not in pool_bodies


def test_pycode_args_variants_differ_only_in_names(prepared):
    for it in prepared["items"]["pycode_args_mc"]:
        right = it["choices"][it["label"]]
        for c in it["choices"]:
            assert re.sub(r"\w+", "W", c) == re.sub(r"\w+", "W", right)


def test_overlap_check_catches_planted_near_duplicates(prepared):
    """The check is not vacuous: slightly edited benchmark items planted in a pool are caught."""
    for name in ("skills_words", "icd10_chapter_mc", "pycode_body_mc", "icd10_code_chapter"):
        items = prepared["items"][name][:20]
        pool = list(prepared["pools"][TASKS[name].dataset])
        planted = []
        for k, it in enumerate(items):
            prompt, ans = item_pair(it)
            user = prompt[len("### Instruction:\n"):-len(RESPONSE)]
            if name == "pycode_body_mc":
                ans = ans.replace("self", "this", 1) if "self" in ans else ans + "\n    pass"
            elif k % 2:
                user = user + " please"
            planted.append(make_record(f"planted-{k}", user, ans, "test"))
        flagged = {i for i, _ in overlap_report(pool + planted, items)}
        assert flagged == set(range(len(pool), len(pool) + len(planted))), name


def test_overlap_index_ignores_templates():
    """Items sharing only a template and a class-label answer are not near-duplicates."""
    tpl = "Which chapter of ICD-10 contains code {}? Answer with the Roman numeral."
    pool = [(render_prompt([{"role": "user", "content": tpl.format(f"K{i:02d}.{i % 10}")}]), "XI")
            for i in range(40)]
    bench = [(render_prompt([{"role": "user", "content": tpl.format("K77.1")}]), "XI")]
    assert OverlapIndex(bench).flag(pool) == [None] * 40
    assert OverlapIndex(bench).flag(pool + bench)[-1].startswith("exact")


# ------------------------------------------------------------------ validation items

def test_val_items_format_and_disjoint_from_test_items(prepared_root):
    """Every task has validation items (<task>.val.jsonl) in the test items' format, with ids
    of their own, and none overlaps a test item of ANY task under decontaminate's check
    (exact, 13-gram, near-duplicate), run as decontaminate runs it: with the pool's
    template statistics (the validation items checked as if they were pool examples)."""
    from clusterft.stages.data.prepare import merge_cfg
    from clusterft.stages.data.decontaminate import load_items, overlaps
    from clusterft.tasks.targets import item_record
    from clusterft.tasks.registry import is_val_file, val_file

    root, summaries = prepared_root
    bench = root / "bench"
    test_items = load_items([bench])
    assert sorted(test_items) == sorted(TASKS)  # the .val.jsonl files are not tasks
    assert all(is_val_file(val_file(bench, t)) and not is_val_file(bench / f"{t}.jsonl")
               for t in TASKS)
    all_pairs = {_norm("".join(item_pair(it))) for its in test_items.values() for it in its}
    test_prompts = {it["prompt"] for its in test_items.values() for it in its}
    for ds, summary in summaries.items():
        pool = load_pool(root / ds / "pool.jsonl")
        recs, counts = [], {}
        for task in tasks_for_dataset(ds):
            val = read_jsonl(val_file(bench, task))
            counts[task] = len(val)
            test_ids = {it["id"] for it in test_items[task]}
            for j, it in enumerate(val, start=1):
                check_item(it, TASKS[task], task, j)
                assert it["id"].startswith(f"{task}-val-") and it["id"] not in test_ids
                assert _norm("".join(item_pair(it))) not in all_pairs
                assert it["prompt"] not in test_prompts, (task, it["id"])
                recs.append(item_record(it, task))
            assert len({it["id"] for it in val}) == len(val)
        assert summary["val"] == counts
        # a few may fall to the overlap check, or (pycode) to the held-out side running short
        assert all(n >= (8 if ds == "pycode" else 12) for n in counts.values()), counts
        flags = overlaps(pool + recs, test_items, merge_cfg(ds, PREPARED_SIZES[ds]))[len(pool):]
        assert flags == [None] * len(recs), [(r["id"], f) for r, f in zip(recs, flags) if f]


def test_val_overlap_check_drops_planted_copies(prepared):
    """drop_overlapping is not vacuous: copies and near-copies of test items planted among
    the validation items are dropped and counted; clean ones are kept in order."""
    from clusterft.pools import OVERLAP_DEFAULTS, drop_overlapping

    items = {"skills_words": prepared["items"]["skills_words"][:30],
             "icd10_chapter_mc": prepared["items"]["icd10_chapter_mc"][:30]}
    exact = dict(items["skills_words"][0], id="skills_words-val-0000")
    near = dict(items["icd10_chapter_mc"][1], id="icd10_chapter_mc-val-0000")
    near["prompt"] = near["prompt"].replace("\n\n### Response:", " please\n\n### Response:")
    clean = [dict(it, id=f"skills_words-val-{k:04d}")
             for k, it in enumerate(prepared["items"]["skills_words"][100:103], start=1)]
    val = {"skills_words": [exact, *clean], "icd10_chapter_mc": [near]}
    pool = prepared["pools"]["skills"] + prepared["pools"]["icd10"]
    kept, dropped = drop_overlapping(val, items, OVERLAP_DEFAULTS, context=pool)
    assert kept == {"skills_words": clean, "icd10_chapter_mc": []}
    assert dropped["skills_words"] == {"exact": 1}
    assert sum(dropped["icd10_chapter_mc"].values()) == 1
