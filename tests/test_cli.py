"""The package's command line runs every stage on its own, on real small inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterft", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_stages_chain_from_the_command_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "data.yaml").write_text("items_per_task: 20\n")
    out = cli("prepare-data", "--dataset", "skills", "--n", "96", "--config", "data.yaml",
              "--out-pool", "pool.jsonl", "--out-labels", "labels.parquet",
              "--out-items", "bench", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    pool = [json.loads(line) for line in (tmp_path / "pool.jsonl").read_text().splitlines()]
    assert len(pool) == 96 and sorted(p.name for p in (tmp_path / "bench").glob("*.jsonl"))

    (tmp_path / "score.yaml").write_text("dim: 16\nwarmup_steps: 2\nbatch_size: 16\n")
    out = cli("score", "--model", str(tiny_model_dir), "--pool", "pool.jsonl", "--config",
              "score.yaml", "--out-features", "f.npy", "--out-scores", "s.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    feats = np.load(tmp_path / "f.npy")
    assert feats.shape == (96, 16)
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, rtol=1e-5)

    out = cli("cluster", "--features", "f.npy", "--scores", "s.parquet", "--k", "4",
              "--out-clusters", "c.parquet", "--out-centroids", "c.npy", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    clusters = pd.read_parquet(tmp_path / "c.parquet")
    assert set(clusters["cluster"]) == {0, 1, 2, 3}

    out = cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "cluster",
              "--budget", "0.25", "--out-selection", "sel.parquet", "--out-summary", "sel.json",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    sel = pd.read_parquet(tmp_path / "sel.parquet")
    assert len(sel) == 24 and set(sel["cluster"]) == {0, 1, 2, 3}


def test_bad_input_gives_a_clear_error_and_exit_code(tmp_path: Path) -> None:
    (tmp_path / "c.parquet").write_bytes(b"")
    out = cli("select", "--clusters", "missing.parquet", "--scores", "s.parquet", "--method",
              "cluster", "--budget", "0.3", "--out-selection", "x.parquet", "--out-summary",
              "x.json", cwd=tmp_path)
    assert out.returncode == 2
    assert "missing.parquet" in out.stderr and "Traceback" not in out.stderr
    out = cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "cluster",
              "--budget", "1.5", "--out-selection", "x.parquet", "--out-summary", "x.json",
              cwd=tmp_path)
    assert out.returncode != 0 and "budget" in out.stderr


def test_help_lists_every_stage(tmp_path: Path) -> None:
    out = cli("--help", cwd=tmp_path)
    for stage in ("prepare-data", "corpus", "tokenizer", "base-model", "score", "cluster",
                  "select", "train", "evaluate", "report"):
        assert stage in out.stdout


def test_score_checks_trains_length_policy_from_the_command_line(tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    pool = Path(__file__).resolve().parent / "bad_inputs" / "data" / "too_long.jsonl"
    args = ("score", "--model", str(tiny_model_dir), "--pool", str(pool), "--out-features",
            "f.npy", "--out-scores", "s.parquet", "--train-max-length", "48")
    out = cli(*args, "--truncation", "error", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{pool}, line 2" in out.stderr and "'ex-1'" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "f.npy").exists()
