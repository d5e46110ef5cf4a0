"""The testbed pool (clusterft.pools.cipher): per-skill counts, one shared vocabulary and
template, items uniform over the skills and disjoint from the pool."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from clusterft.pipeline.errors import InputError
from clusterft.pools import cipher, zipf_counts
from clusterft.stages.data.prepare import merge_cfg

SMALL = {"n": 900, "n_skills": 6, "n_words": 10, "words_per_example": 3, "zipf_s": 1.2,
         "items_per_skill": 20, "held_out": 40, "val_per_task": 12}
PATTERN = re.compile(r"^Encode with cipher (\w+): ((?:\w+ ?)+)$")


@pytest.fixture(scope="module")
def built():
    return cipher.build(dict(SMALL), seed=3)


def _parse(user: str) -> tuple[str, tuple[str, ...]]:
    m = PATTERN.match(user)
    assert m, user
    return m.group(1), tuple(m.group(2).split())


def test_counts_follow_zipf_and_labels_are_keys(built):
    want = dict(zip(cipher.skill_names(SMALL), zipf_counts(900, 6, 1.2)))
    assert Counter(built.labels) == want
    assert want[cipher.KEYS[0]] > 5 * want[cipher.KEYS[5]]  # skewed: the rare skills are rare
    for rec, lab in zip(built.records, built.labels):
        key, _ = _parse(rec["messages"][0]["content"])
        assert key == lab


def test_one_vocabulary_one_template_and_answers_apply_the_mapping(built):
    vocab = set(cipher.WORDS[:10])
    maps = built.extra["mappings"]
    for key, m in maps.items():  # each cipher is a permutation of the same words
        assert set(m) == vocab and set(m.values()) == vocab
    assert len({tuple(m.items()) for m in maps.values()}) == len(maps)
    for rec in built.records:
        key, ws = _parse(rec["messages"][0]["content"])
        assert rec["messages"][0]["content"] == cipher.TEMPLATE.format(key=key, w=" ".join(ws))
        assert len(ws) == 3 and set(ws) <= vocab
        assert rec["messages"][1]["content"] == " " + " ".join(maps[key][w] for w in ws)


def test_items_uniform_over_skills_and_disjoint_from_the_pool(built):
    items = built.items[cipher.TASK]
    assert Counter(it["group"] for it in items) == {k: 20 for k in cipher.skill_names(SMALL)}
    pool_tuples = {_parse(r["messages"][0]["content"])[1] for r in built.records}
    maps = built.extra["mappings"]
    seen = set()
    for it in items:
        user = it["prompt"].split("### Instruction:\n")[1].split("\n\n### Response:")[0]
        key, ws = _parse(user)
        assert ws not in pool_tuples  # no input of an item is in the pool, under any key
        assert it["answer"] == " ".join(maps[key][w] for w in ws)
        seen.add((key, ws))
    assert len(seen) == len(items)
    vals = built.val_items[cipher.TASK]
    assert len(vals) == 12
    for it in vals:
        user = it["prompt"].split("### Instruction:\n")[1].split("\n\n### Response:")[0]
        key, ws = _parse(user)
        assert (key, ws) not in seen and ws not in pool_tuples


def test_deterministic_by_seed():
    a, b = cipher.build(dict(SMALL), seed=3), cipher.build(dict(SMALL), seed=3)
    c = cipher.build(dict(SMALL), seed=4)
    assert a.records == b.records and a.items == b.items
    assert a.extra["mappings"] != c.extra["mappings"]


@pytest.mark.parametrize("bad,field", [({"n_skills": 1}, "n_skills"), ({"n_words": 1}, "n_words"),
                                       ({"held_out": 10}, "held_out"),
                                       ({"held_out": 10_000}, "held_out"), ({"n": 5000}, "n")])
def test_impossible_settings_are_refused_naming_the_field(bad, field):
    with pytest.raises(InputError) as e:
        cipher.build({**SMALL, **bad})
    assert e.value.field == f"cipher.{field}"
    with pytest.raises(InputError) as e:  # the config check, before any work
        merge_cfg("cipher", {**SMALL, **bad}, "testbed")
    assert e.value.field == f"datasets.testbed.{field}"


def test_practice_ciphers_use_other_keys_and_permutations_than_the_testbed():
    """A practised base model must never have met a testbed cipher: the practice pool's keys
    are disjoint from the testbed's and its permutations come from another random stream."""
    from clusterft.pools import cipher

    shape = {"n": 900, "n_skills": 8, "n_words": 12, "words_per_example": 3, "zipf_s": 1.0}
    test = cipher.build(shape, seed=0)
    practice = cipher.build(shape, seed=0, practice=True)
    assert set(test.labels) == set(cipher.KEYS[:8])
    assert set(practice.labels) == set(cipher.PRACTICE_KEYS)
    assert not set(test.labels) & set(practice.labels)
    tables = [tuple(m.values()) for m in test.extra["mappings"].values()]
    assert not set(tables) & {tuple(m.values()) for m in practice.extra["mappings"].values()}
    # the same vocabulary and template: only the keys and the tables differ
    words = {w for r in practice.records for w in r["messages"][-1]["content"].split()}
    assert words <= set(cipher.WORDS[:12])
