"""clusterft.tools.compare on two small results trees: byte identity per stage and the accuracy
spread between trees next to the spread between seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clusterft.tools.compare import compare, main, render


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


def _selection(root: Path, cell: str, seed: int, ids: list[str]) -> None:
    import pandas as pd

    d = root / "select" / cell / f"s{seed}"
    d.mkdir(parents=True)
    pd.DataFrame({"id": ids, "cluster": 0, "score": 0.0}).to_parquet(d / "selection.parquet")


def _metrics(root: Path, rel: str, final_loss: float) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"final_loss": final_loss}))


def test_selection_overlap_and_losses(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    cell = "skills/small/cluster-0.31"
    _selection(a, cell, 0, ["1", "2", "3", "4"])
    _selection(a, cell, 1, ["5", "6", "7", "8"])
    _selection(b, cell, 0, ["1", "2", "3", "5"])  # 3 of 5 distinct ids shared
    _selection(b, cell, 1, ["5", "6", "7", "8"])
    _metrics(a, "models/small/base/pretrain_metrics.json", 2.0)
    _metrics(b, "models/small/base/pretrain_metrics.json", 2.02)
    _metrics(a, "train/skills/small/full-1/g1-balanced/s0/train_metrics.json", 1.0)
    _metrics(b, "train/skills/small/full-1/g1-balanced/s0/train_metrics.json", 1.0)
    res = compare(a, b)
    same = res["selections"]["same"]
    assert same["n"] == 2 and same["min"] == pytest.approx(3 / 5) and same["mean"] == pytest.approx(0.8)
    # seeds within a: disjoint; within b: {5} shared of 7
    assert res["selections"]["seeds"]["n"] == 2
    assert res["selections"]["seeds"]["mean"] == pytest.approx((0 + 1 / 7) / 2)
    losses = {r["kind"]: r for r in res["losses"]}
    assert losses["base-model pretraining"]["max_rel"] == pytest.approx(0.02 / 2.02)
    assert losses["fine-tuning"]["n"] == 1 and losses["fine-tuning"]["max_rel"] == 0
    text = render(res)
    assert "| same selection, A vs B | 2 | 0.800 | 0.600 |" in text
