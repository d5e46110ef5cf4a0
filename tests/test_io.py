"""Atomic outputs, readers with precise errors, and the prompt format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path, read_json, read_jsonl, write_jsonl
from clusterft.modeling.prompt import render_example, render_prompt


def test_atomic_file_is_absent_until_success(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert not target.exists()
    assert list((tmp_path / "sub").iterdir()) == []  # no temp left behind
    with atomic_path(target) as tmp:
        tmp.write_text("{}")
    assert target.read_text() == "{}"


def test_atomic_dir_replaces_whole(tmp_path: Path) -> None:
    d = tmp_path / "model"
    with atomic_path(d, is_dir=True) as tmp:
        (tmp / "a").write_text("1")
    with atomic_path(d, is_dir=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in d.iterdir()) == ["b"]


def test_read_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "pool.jsonl"
    p.write_bytes(b'{"id": "a"}\n{"id": \n')
    with pytest.raises(InputError, match=r"pool\.jsonl, line 2: malformed JSON"):
        read_jsonl(p)
    p.write_bytes(b'{"id": "a"}\n\n{"id": "\xff"}\n')
    with pytest.raises(InputError, match=r"line 3: not valid UTF-8"):
        read_jsonl(p)
    p.write_text('[1, 2]\n')
    with pytest.raises(InputError, match=r"line 1: each line must be a JSON object"):
        read_jsonl(p)
    with pytest.raises(InputError, match=r"nope\.jsonl.*does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="does not exist"):
        read_json(tmp_path / "nope.json")


def test_jsonl_roundtrip(tmp_path: Path) -> None:
    recs = [{"id": str(i), "text": "é" * i} for i in range(3)]
    write_jsonl(tmp_path / "x.jsonl", recs)
    assert read_jsonl(tmp_path / "x.jsonl") == recs
    assert json.loads((tmp_path / "x.jsonl").read_text().splitlines()[2])["text"] == "éé"


def test_prompt_format_is_shared() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: b a"},
            {"role": "assistant", "content": "a b"}]
    prompt, response = render_example(msgs)
    assert prompt == "### Instruction:\nBe brief.\n\nSort: b a\n\n### Response:\n"
    assert response == "a b"
    assert render_prompt(msgs[:2]) == prompt
