"""clusterft.compare on two small results trees: byte identity per stage and the accuracy
spread between trees next to the spread between seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clusterft.compare import compare, main, render


def _tree(root: Path, pool: str, accs: dict[str, tuple[float, float]]) -> Path:
    (root / "data/skills").mkdir(parents=True)
    (root / "data/skills/pool.jsonl").write_text(pool)
    (root / "corpus").mkdir()
    (root / "corpus/general.txt").write_text("same corpus\n")
    for cell, per_seed in accs.items():
        for seed, v in enumerate(per_seed):
            d = root / "eval" / cell / f"s{seed}"
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"average": v, "tasks": {}}))
    return root


def test_identity_and_spread(tmp_path: Path) -> None:
    cells = "skills/small/full-1/g1-balanced", "skills/small/random-0.31/g1-balanced"
    a = _tree(tmp_path / "a", '{"id": 1}\n', {cells[0]: (0.30, 0.34), cells[1]: (0.20, 0.20)})
    b = _tree(tmp_path / "b", '{"id": 2}\n', {cells[0]: (0.31, 0.34), cells[1]: (0.23, 0.19)})
    res = compare(a, b)
    files = {r["stage"]: r for r in res["files"]}
    assert files["corpus"]["files"] == 1 and files["corpus"]["identical"] == 1
    assert files["pools"]["files"] == 1 and files["pools"]["identical"] == 0
    acc = res["accuracy"]
    assert acc["runs"]["n"] == 4
    assert acc["runs"]["max_abs"] == pytest.approx(0.03)
    assert acc["runs"]["rms"] == pytest.approx(math.sqrt((0.01**2 + 0 + 0.03**2 + 0.01**2) / 4))
    # cell means: full (0.32 vs 0.325), random (0.20 vs 0.21)
    assert acc["cell_means"]["max_abs"] == pytest.approx(0.01)
    # seed 0 - seed 1 in both trees: -0.04, 0, -0.03, 0.04
    assert acc["seeds"]["n"] == 4 and acc["seeds"]["max_abs"] == pytest.approx(0.04)
    assert acc["largest"][0]["run"] == f"{cells[1]}/s0"
    text = render(res)
    assert "| corpus | 1 | 1 |" in text and "| pools | 1 | 0 |" in text


def test_cli_writes_markdown_and_json(tmp_path: Path, capsys) -> None:
    a = _tree(tmp_path / "a", "x\n", {"d/m/full-1/g1-balanced": (0.5, 0.5)})
    b = _tree(tmp_path / "b", "x\n", {"d/m/full-1/g1-balanced": (0.5, 0.5)})
    assert main([str(a), str(b), "--out", str(tmp_path / "c.md"), "--json",
                 str(tmp_path / "c.json")]) == 0
    assert "| pools | 1 | 1 |" in (tmp_path / "c.md").read_text()
    assert json.loads((tmp_path / "c.json").read_text())["accuracy"]["runs"]["max_abs"] == 0
    with pytest.raises(SystemExit, match="not a results folder"):
        compare(tmp_path / "a", tmp_path / "missing")
