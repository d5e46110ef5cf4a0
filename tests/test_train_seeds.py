"""Several runs (one run's seeds) in one `python -m clusterft.stages.train` process, as the
workflow's train_seeds jobs run them: each run's outputs equal those of a process of its
own, and mismatched or missing inputs are refused before any training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterft.stages.train import main
from test_train import make_selection

CFG = {"batch_size": 4, "epochs": 1, "max_length": 64, "lr": 3e-3, "log_every": 1}
TIMES = {"wall_time_s", "mean_step_time_s", "total_time_s"}


def train_cli(cwd: Path, model: Path, pool: Path, sels: list[Path], outs: list[Path],
              mets: list[Path], seeds: list[int]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "clusterft.stages.train", "--model", str(model), "--pool", str(pool),
           "--selection", *map(str, sels), "--out", *map(str, outs),
           "--metrics", *map(str, mets), "--seed", *map(str, seeds),
           "--distribution", "balanced", "--threads", "1", "--config", json.dumps(CFG)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_seeds_in_one_process_equal_a_process_each(tmp_path, tiny_model_dir, tiny_pool,
                                                   tiny_pool_path):
    sels = [make_selection(tmp_path / "a.parquet", tiny_pool, 16),
            make_selection(tmp_path / "b.parquet", tiny_pool, 24, k=3)]
    seeds = [3, 4]
    fused = train_cli(tmp_path, tiny_model_dir, tiny_pool_path, sels,
                      [tmp_path / f"f{i}" for i in (0, 1)],
                      [tmp_path / f"f{i}.json" for i in (0, 1)], seeds)
    assert fused.returncode == 0, fused.stderr[-3000:]
    assert "run 2 of 2: seed 4" in fused.stderr
    for i in (0, 1):
        own = train_cli(tmp_path, tiny_model_dir, tiny_pool_path, [sels[i]],
                        [tmp_path / f"u{i}"], [tmp_path / f"u{i}.json"], [seeds[i]])
        assert own.returncode == 0, own.stderr[-3000:]
        assert ((tmp_path / f"f{i}" / "model.safetensors").read_bytes()
                == (tmp_path / f"u{i}" / "model.safetensors").read_bytes())
        a = json.loads((tmp_path / f"f{i}.json").read_text())
        b = json.loads((tmp_path / f"u{i}.json").read_text())
        assert a["seed"] == seeds[i] and a["examples"] == (16, 24)[i]
        assert {k: v for k, v in a.items() if k not in TIMES} == \
            {k: v for k, v in b.items() if k not in TIMES}
    # the two runs differ (their selections and seeds do)
    assert ((tmp_path / "f0" / "model.safetensors").read_bytes()
            != (tmp_path / "f1" / "model.safetensors").read_bytes())


def test_mismatched_runs_are_refused_before_training(tmp_path, tiny_model_dir, tiny_pool,
                                                     tiny_pool_path, capsys, monkeypatch):
    sel = make_selection(tmp_path / "a.parquet", tiny_pool, 8)
    base = ["--model", str(tiny_model_dir), "--pool", str(tiny_pool_path),
            "--config", json.dumps(CFG)]
    outs = ["--out", str(tmp_path / "o0"), str(tmp_path / "o1")]
    mets = ["--metrics", str(tmp_path / "m0.json"), str(tmp_path / "m1.json")]
    # two outputs, one seed
    assert main([*base, "--selection", str(sel), str(sel), *outs, *mets, "--seed", "0"]) == 2
    assert "--seed" in capsys.readouterr().err
    # the second run's selection is missing: named before the first run trains
    missing = tmp_path / "nope.parquet"
    assert main([*base, "--selection", str(sel), str(missing), *outs, *mets,
                 "--seed", "0", "1"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--selection" in err
    # the same output twice
    assert main([*base, "--selection", str(sel), str(sel), "--out", str(tmp_path / "o0"),
                 str(tmp_path / "o0"), *mets, "--seed", "0", "1"]) == 2
    assert "same --out" in capsys.readouterr().err
    # several runs under torchrun's ranks
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*base, "--selection", str(sel), str(sel), *outs, *mets,
                 "--seed", "0", "1"]) == 2
    assert "one rank" in capsys.readouterr().err
    assert not any(tmp_path.glob("o*")) and not any(tmp_path.glob("m*.json"))
