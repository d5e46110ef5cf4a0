"""Pool schema validation (every error names file, line, field), writing, user data loading."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from clusterft.stages.data.prepare import DEFAULTS, load_hf_pool, merge_cfg, run_prepare_data
from clusterft.pools.poolfile import load_pool, validate_example, write_pool
from clusterft.pipeline.errors import InputError


def rec(i: int, user: str = "Reverse: a b", answer: str = " b a", **kw) -> dict:
    r = {"id": f"ex-{i}", "messages": [{"role": "user", "content": user},
                                       {"role": "assistant", "content": answer}],
         "source": "test"}
    r.update(kw)
    return r


def write_lines(path, lines: list) -> str:
    with open(path, "wb") as f:
        for ln in lines:
            if isinstance(ln, bytes):
                f.write(ln + b"\n")
            elif isinstance(ln, str):
                f.write(ln.encode("utf-8") + b"\n")
            else:
                f.write(json.dumps(ln).encode("utf-8") + b"\n")
    return str(path)


def assert_error(path, match_line: int | None, field: str | None, fn=load_pool):
    with pytest.raises(InputError) as ei:
        fn(path)
    msg = str(ei.value)
    assert str(path) in msg
    if match_line is not None:
        assert f"line {match_line}" in msg and ei.value.line == match_line
    if field is not None:
        assert f"field '{field}'" in msg and ei.value.field == field
    return msg


def test_valid_pool_roundtrip(tmp_path):
    recs = [rec(i) for i in range(5)]
    p = tmp_path / "pool.jsonl"
    assert write_pool(p, recs) == 5
    back = load_pool(p)
    assert back == recs
    assert load_pool(p, max_examples=2) == recs[:2]


def test_blank_lines_are_skipped_and_source_defaults_to_stem(tmp_path):
    r = rec(0)
    del r["source"]
    p = write_lines(tmp_path / "mine.jsonl", [r, "", rec(1)])
    back = load_pool(p)
    assert [x["id"] for x in back] == ["ex-0", "ex-1"] and back[0]["source"] == "mine"


def test_malformed_json_names_line(tmp_path):
    p = write_lines(tmp_path / "p.jsonl", [rec(0), '{"id": "x", "messages": [', rec(2)])
    msg = assert_error(p, 2, None)
    assert "malformed JSON" in msg


def test_non_utf8_names_line(tmp_path):
    p = write_lines(tmp_path / "p.jsonl", [rec(0), rec(1), b'{"id": "\xff\xfe"}'])
    assert "UTF-8" in assert_error(p, 3, None)


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.pop("messages"), "messages"),
    (lambda r: r.update(messages=[]), "messages"),
    (lambda r: r.update(messages="hello"), "messages"),
    (lambda r: r.pop("id"), "id"),
    (lambda r: r.update(id=""), "id"),
    (lambda r: r.update(id=7), "id"),
    (lambda r: r["messages"][0].pop("role"), "messages[0].role"),
    (lambda r: r["messages"][0].update(role="human"), "messages[0].role"),
    (lambda r: r["messages"][1].update(content="   "), "messages[1].content"),
    (lambda r: r["messages"][1].pop("content"), "messages[1].content"),
    (lambda r: r["messages"][0].update(content=3), "messages[0].content"),
    (lambda r: r["messages"].append({"role": "user", "content": "more"}), "messages[2].role"),
    (lambda r: r["messages"].insert(0, {"role": "assistant", "content": "hi"}), "messages"),
    (lambda r: r["messages"].insert(1, {"role": "system", "content": "sys"}), "messages[1].role"),
    (lambda r: r.update(messages=[{"role": "assistant", "content": "x"}]), "messages"),
    (lambda r: r.update(source=5), "source"),
])
def test_bad_record_names_line_and_field(tmp_path, mutate, field):
    bad = rec(1)
    mutate(bad)
    p = write_lines(tmp_path / "p.jsonl", [rec(0), bad, rec(2)])
    assert_error(p, 2, field)


def test_duplicate_id_names_both_lines(tmp_path):
    p = write_lines(tmp_path / "p.jsonl", [rec(0), rec(1), rec(0)])
    msg = assert_error(p, 3, "id")
    assert "first seen on line 1" in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_pool(tmp_path / "nope.jsonl")
    p = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(InputError, match="empty"):
        load_pool(p)


def test_not_an_object(tmp_path):
    p = write_lines(tmp_path / "p.jsonl", [rec(0), [1, 2]])
    assert_error(p, 2, "(record)")


def test_system_message_first_is_valid():
    r = rec(0)
    r["messages"].insert(0, {"role": "system", "content": "Be brief."})
    assert validate_example(r, "x.jsonl", 1)["id"] == "ex-0"


def test_write_pool_validates(tmp_path):
    bad = rec(1)
    bad["messages"][1]["content"] = ""
    with pytest.raises(InputError) as ei:
        write_pool(tmp_path / "o.jsonl", [rec(0), bad])
    assert ei.value.line == 2 and ei.value.field == "messages[1].content"
    assert not (tmp_path / "o.jsonl").exists()
    with pytest.raises(InputError, match="duplicate id"):
        write_pool(tmp_path / "o.jsonl", [rec(0), rec(0)])


def test_defaults_and_merge():
    assert set(DEFAULTS) >= {"skills", "pycode", "icd10", "jsonl", "hf"}
    for name in ("skills", "pycode", "icd10"):
        assert {"n", "items_per_task", "ngram_n"} <= set(DEFAULTS[name])
    m = merge_cfg("skills", {"n": 100, "domain": "programming", "source": "skills"})
    assert m["n"] == 100 and "domain" not in m
    with pytest.raises(InputError) as ei:
        merge_cfg("skills", {"nn": 3}, "skills")
    assert ei.value.field == "datasets.skills.nn"  # the unknown key itself
    with pytest.raises(InputError, match="unknown data source"):
        merge_cfg("wiki", {})


def test_val_per_task_key():
    for name in ("skills", "pycode", "icd10"):
        assert DEFAULTS[name]["val_per_task"] == 16
        assert merge_cfg(name, {"val_per_task": 0})["val_per_task"] == 0
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(InputError) as ei:
            merge_cfg("skills", {"val_per_task": bad}, "mine")
        assert ei.value.field == "datasets.mine.val_per_task"
    # accepted (and unused) for a user's own pool, like items_per_task
    assert "val_per_task" not in merge_cfg("jsonl", {"path": "x", "val_per_task": 8})


# ------------------------------------------------------------------ user data (HF path)

def alpaca_file(tmp_path, rows: list[dict]) -> str:
    p = tmp_path / "alpaca.json"
    p.write_text(json.dumps(rows), encoding="utf-8")
    return str(p)


ROWS = [{"instruction": "Add the numbers.", "input": "2 3", "output": "5", "topic": "math"},
        {"instruction": "Name a colour.", "input": "", "output": "red", "topic": "art"},
        {"instruction": "Reverse: a b", "input": "", "output": "b a", "topic": "words"}]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(v, "1")


def test_load_hf_pool_from_local_json(tmp_path):
    path = alpaca_file(tmp_path, ROWS)
    recs, labels = load_hf_pool("json", {"user": "instruction", "input": "input",
                                         "assistant": "output", "label": "topic"},
                                data_files=path)
    assert [r["id"] for r in recs] == ["hf-00000", "hf-00001", "hf-00002"]
    assert recs[0]["messages"] == [{"role": "user", "content": "Add the numbers.\n\n2 3"},
                                   {"role": "assistant", "content": "5"}]
    assert recs[1]["messages"][0]["content"] == "Name a colour."
    assert labels == ["math", "art", "words"]


def test_load_hf_pool_errors(tmp_path):
    path = alpaca_file(tmp_path, ROWS)
    with pytest.raises(InputError) as ei:
        load_hf_pool("json", {"user": "question", "assistant": "output"}, data_files=path)
    assert ei.value.field == "columns" and "question" in str(ei.value)
    bad = alpaca_file(tmp_path, ROWS + [{"instruction": "x", "input": "", "output": "",
                                         "topic": "t"}])
    with pytest.raises(InputError) as ei:
        load_hf_pool("json", {"user": "instruction", "assistant": "output"}, data_files=bad)
    assert ei.value.line == 4 and ei.value.field == "messages[1].content"
    with pytest.raises(InputError, match="could not load"):
        load_hf_pool("json", {"user": "instruction", "assistant": "output"},
                     data_files=str(tmp_path / "missing.json"))


def test_prepare_custom_sources(tmp_path):
    path = alpaca_file(tmp_path, ROWS)
    s = run_prepare_data("mine", {"source": "hf", "hf_dataset": "json", "data_files": path,
                                  "columns": {"user": "instruction", "assistant": "output",
                                              "label": "topic"}, "n": 2},
                         tmp_path / "hf" / "pool.jsonl", tmp_path / "hf" / "labels.parquet",
                         tmp_path / "bench")
    assert s["n"] == 2 and s["tasks"] == {}
    assert [r["id"] for r in load_pool(tmp_path / "hf" / "pool.jsonl")] == ["mine-00000",
                                                                            "mine-00001"]
    lab = pd.read_parquet(tmp_path / "hf" / "labels.parquet")
    assert list(lab["label"]) == ["math", "art"]
    assert not list((tmp_path / "bench").glob("*.jsonl"))  # no benchmark items of its own
    assert s["val"] == {} and s["val_dropped"] == {}

    src = write_lines(tmp_path / "own.jsonl", [rec(i, label=f"L{i % 2}") for i in range(4)])
    s = run_prepare_data("own", {"source": "jsonl", "path": src, "label_field": "label",
                                 "items_per_task": 200},
                         tmp_path / "own" / "pool.jsonl", tmp_path / "own" / "labels.parquet",
                         tmp_path / "bench")
    assert s["label_counts"] == {"L0": 2, "L1": 2}
    with pytest.raises(InputError) as ei:
        run_prepare_data("own", {"source": "jsonl"}, tmp_path / "x.jsonl",
                         tmp_path / "x.parquet", tmp_path / "bench")
    assert ei.value.field == "datasets.own.path"
