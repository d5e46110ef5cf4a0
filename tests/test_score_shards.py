"""Sharded scoring (score.shards; clusterft.stages.score.entry) on the tiny real Llama: one warm-up,
N shards and the merge write the same bytes as one score job; shards cover the pool once;
shards of another warm-up are refused; the workflow plans one warm-up and N shard jobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from clusterft.stages import score as sh
from clusterft.stages.score import entry as score_entry
from clusterft.cli import main as cli_main
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_jsonl
from clusterft.pipeline.provenance import sidecar_path
from clusterft.stages.score import Checkpoints, run_score

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
# Two warm-up checkpoints with Adam directions and LoRA dropout: every piece of state the
# warm-up hands to the shards (adapters, moments, loss-step snapshots) is exercised.
CFG = {"dim": 16, "batch_size": 8, "max_length": 64, "warmup_steps": 4, "warmup_lr": 5e-3,
       "warmup_fraction": 0.25, "warmup_checkpoints": 2, "loss_points": 3,
       "gradient_type": "adam", "checkpoint_every": 1, "num_threads": 1,
       "lora": {"r": 4, "alpha": 8, "dropout": 0.1}}
OUTS = ("features.npy", "scores.parquet", "trajectories.npy", "targets.npy", "targets.parquet")
N_POOL = 44  # 6 batches of 8, the last one short


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_pool):
    """A pool of N_POOL tiny examples and target records (two tasks) in pool format."""
    root = tmp_path_factory.mktemp("shard_inputs")
    write_jsonl(root / "pool.jsonl", tiny_pool[:N_POOL])
    t_recs = [dict(r, id=f"val-{i}") for i, r in enumerate(tiny_pool[50:56])]
    targets = (t_recs, ["task_a"] * 3 + ["task_b"] * 3)
    return root / "pool.jsonl", targets


def _outs(folder: Path) -> dict:
    return {k: folder / k for k in OUTS}


def _score_args(o: dict) -> dict:
    return {"out_trajectories": o["trajectories.npy"], "out_targets": o["targets.npy"],
            "out_target_ids": o["targets.parquet"]}


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, tiny_model_dir, inputs):
    pool, targets = inputs
    o = _outs(tmp_path_factory.mktemp("one_job"))
    run_score(tiny_model_dir, pool, CFG, o["features.npy"], o["scores.parquet"], seed=0,
              targets=targets, **_score_args(o))
    return o


@pytest.fixture(scope="module")
def warmup(tmp_path_factory, tiny_model_dir, inputs):
    pool, _ = inputs
    out = tmp_path_factory.mktemp("warmup") / "warmup.safetensors"
    sh.run_score_warmup(tiny_model_dir, pool, CFG, out, seed=0)
    return out


def _shards(tiny_model_dir, pool, targets, warmup, folder: Path, shards: int, seed=0):
    cfg = {**CFG, "shards": shards}
    paths = [folder / f"shard{i}.npz" for i in range(shards)]
    for i, p in enumerate(paths):
        sh.run_score_shard(tiny_model_dir, pool, warmup, cfg, i, p, seed=seed, targets=targets)
    return cfg, paths


@pytest.mark.parametrize("shards", [2, 3])
def test_merged_shards_are_the_one_job_outputs_bit_for_bit(tmp_path, tiny_model_dir, inputs,
                                                           unsharded, warmup, shards):
    """Every shard runs the one-job gradient pass's own batches from the same warm-up
    state, so nothing differs, not even float rounding: the files are byte-identical."""
    pool, targets = inputs
    cfg, paths = _shards(tiny_model_dir, pool, targets, warmup, tmp_path, shards)
    o = _outs(tmp_path / "merged")
    info = sh.run_score_merge(tiny_model_dir, pool, warmup, paths, cfg, o["features.npy"],
                        o["scores.parquet"], seed=0, targets=targets, **_score_args(o))
    assert info["n"] == N_POOL and info["n_targets"] == 6 and info["checkpoint_steps"] == [2, 4]
    for name in OUTS:
        assert o[name].read_bytes() == unsharded[name].read_bytes(), name
    f = np.load(o["features.npy"])
    assert f.shape == (N_POOL, 32) and np.isfinite(np.load(o["trajectories.npy"])).all()
    side = {k: json.loads(sidecar_path(p).read_text()) for k, p in o.items()}
    one = json.loads(sidecar_path(unsharded["features.npy"]).read_text())
    # the same score run for everything downstream (its digest is of the outputs' digests)
    digests = {k: v["digest"] for k, v in side["features.npy"]["lineage"].items()}
    assert digests == {k: v["digest"] for k, v in one["lineage"].items()}
    assert set(digests) == {"pool", "tokenizer", "score_run"}
    assert side["features.npy"]["config"]["shards"] == shards
    assert {f"shards[{i}]" for i in range(shards)} <= set(side["features.npy"]["inputs"])
    assert not any(Path(str(p) + ".ckpt").exists() for p in paths)


@pytest.mark.parametrize("lengths, bs, shards", [
    ([5] * 44, 8, 2), ([5] * 44, 8, 3), (list(range(100, 0, -1)), 7, 4),
    ([3, 9, 1, 30, 2, 2, 8], 2, 7),  # more shards than batches: some stay empty
    (list(np.random.default_rng(0).integers(1, 200, 1000)), 16, 5),
])
def test_shard_bounds_cover_the_pool_once_at_batch_boundaries(lengths, bs, shards):
    bounds = sh.shard_bounds(lengths, bs, shards)
    n = len(lengths)
    assert len(bounds) == shards and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:]))  # consecutive
    assert all(lo <= hi and (lo % bs == 0 or lo == n) for lo, hi in bounds)
    # balanced: no shard holds more than its share plus one batch of padded tokens
    srt = np.sort(lengths, kind="stable")
    cost = [sum(min(bs, hi - b) * srt[min(b + bs, hi) - 1] for b in range(lo, hi, bs))
            for lo, hi in bounds]
    total = sum(cost)
    biggest = max(min(bs, n - b) * srt[min(b + bs, n) - 1] for b in range(0, n, bs))
    assert max(cost) <= total / shards + biggest


def test_warmup_file_holds_what_the_shards_need(warmup, inputs):
    w = sh.load_warmup(warmup)
    assert [c["step"] for c in w["checkpoints"]] == [2, 4]
    assert all(c["lora"] and c["exp_avg"] is not None for c in w["checkpoints"])
    assert sorted(w["loss_snapshots"]) == [0, 2, 4] == w["info"]["loss_steps"]
    assert len(w["lengths"]) == N_POOL
    side = json.loads(sidecar_path(warmup).read_text())
    assert side["stage"] == "score_warmup" and "shards" not in side["config"]
    assert side["lineage"]["score_warmup"]["digest"] == side["digest"]


def test_merge_refuses_shards_of_another_warmup_or_order(tmp_path, tiny_model_dir, inputs,
                                                         warmup):
    pool, targets = inputs
    cfg, paths = _shards(tiny_model_dir, pool, targets, warmup, tmp_path / "a", 2)
    other = tmp_path / "other.safetensors"  # another warm-up: seed 1
    sh.run_score_warmup(tiny_model_dir, pool, CFG, other, seed=1)
    sh.run_score_shard(tiny_model_dir, pool, other, cfg, 1, tmp_path / "b1.npz", seed=1)
    o = _outs(tmp_path / "merged")
    with pytest.raises(InputError, match=r"do not belong together.*score_warmup") as e:
        sh.run_score_merge(tiny_model_dir, pool, warmup, [paths[0], tmp_path / "b1.npz"], cfg,
                     o["features.npy"], o["scores.parquet"], seed=0)
    assert "b1.npz" in str(e.value)
    with pytest.raises(InputError, match="expected shard 0 of 2"):
        sh.run_score_merge(tiny_model_dir, pool, warmup, paths[::-1], cfg, o["features.npy"],
                     o["scores.parquet"], seed=0)
    with pytest.raises(InputError, match=r"score\.shards"):
        sh.run_score_merge(tiny_model_dir, pool, warmup, paths[:1], cfg, o["features.npy"],
                     o["scores.parquet"], seed=0)
    with pytest.raises(InputError, match="another score config"):  # shard of seed 0's warm-up
        sh.run_score_shard(tiny_model_dir, pool, warmup, cfg, 0, tmp_path / "x.npz", seed=1)
    assert not (tmp_path / "merged" / "features.npy").exists()
    with pytest.raises(InputError, match=r"score\.shards = 45 is larger than the pool"):
        sh.run_score_warmup(tiny_model_dir, pool, {**CFG, "shards": 45}, tmp_path / "w.safetensors")


class Killed(Exception):
    pass


def _killing(name: str, count: int):
    class KillingCheckpoints(Checkpoints):
        """Stops the run right after its ``count``-th save of ``name``."""

        left = count

        def save(self, n, blob):
            super().save(n, blob)
            if n == name:
                type(self).left -= 1
                if type(self).left == 0:
                    raise Killed(n)
    return KillingCheckpoints


def test_killed_warmup_and_shard_resume_to_the_same_files(tmp_path, tiny_model_dir, inputs,
                                                          warmup, monkeypatch):
    pool, targets = inputs
    w2 = tmp_path / "warmup.safetensors"
    with monkeypatch.context() as m:
        m.setattr(score_entry, "Checkpoints", _killing("warmup.pt", 1))  # after checkpoint 1 of 2
        with pytest.raises(Killed):
            sh.run_score_warmup(tiny_model_dir, pool, CFG, w2, seed=0)
    assert not w2.exists() and (tmp_path / "warmup.safetensors.ckpt" / "warmup.pt").exists()
    info = sh.run_score_warmup(tiny_model_dir, pool, CFG, w2, seed=0)
    assert info["warmup_resumed"] and w2.read_bytes() == warmup.read_bytes()

    cfg, ref = _shards(tiny_model_dir, pool, targets, warmup, tmp_path / "ref", 2)
    out = tmp_path / "shard0.npz"
    with monkeypatch.context() as m:
        # killed inside checkpoint 2's pass
        m.setattr(score_entry, "Checkpoints", _killing("gradients.pt", 4))
        with pytest.raises(Killed):
            sh.run_score_shard(tiny_model_dir, pool, warmup, cfg, 0, out, seed=0, targets=targets)
    assert not out.exists()
    info = sh.run_score_shard(tiny_model_dir, pool, warmup, cfg, 0, out, seed=0, targets=targets)
    assert info["gradients_resumed_at"] is not None
    assert info["gradients_resumed_at"]["checkpoint"] == 1
    with np.load(out) as a, np.load(ref[0]) as b:
        assert set(a.files) == set(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_cli_runs_warmup_shards_and_merge(tmp_path, tiny_model_dir, inputs, unsharded,
                                          capsys):
    pool, _ = inputs
    (tmp_path / "score.yaml").write_text(yaml.safe_dump({**CFG, "shards": 2}))
    common = ["--model", str(tiny_model_dir), "--pool", str(pool), "--config",
              str(tmp_path / "score.yaml")]
    assert cli_main(["score-warmup", *common, "--out", str(tmp_path / "w.safetensors")]) == 0
    for i in range(2):
        assert cli_main(["score-shard", *common, "--warmup", str(tmp_path / "w.safetensors"),
                         "--shard", str(i), "--out", str(tmp_path / f"s{i}.npz")]) == 0
    assert cli_main(["score-merge", *common, "--warmup", str(tmp_path / "w.safetensors"),
                     "--shards", str(tmp_path / "s0.npz"), str(tmp_path / "s1.npz"),
                     "--out-features", str(tmp_path / "f.npy"), "--out-scores",
                     str(tmp_path / "s.parquet"), "--out-trajectories",
                     str(tmp_path / "t.npy")]) == 0
    assert (tmp_path / "f.npy").read_bytes() == unsharded["features.npy"].read_bytes()
    assert (tmp_path / "t.npy").read_bytes() == unsharded["trajectories.npy"].read_bytes()
    capsys.readouterr()


@pytest.mark.parametrize("value, match", [
    (0, "must be an integer >= 1"), ("2", "must be an integer >= 1"),
    (201, r"larger than the pool of dataset 'cipher' \(200 examples\)")])
def test_config_check_names_score_shards(value, match):
    from clusterft.plan.config import check_config

    cfg = yaml.safe_load((ROOT / ".test" / "config.yaml").read_text())
    cfg["score"]["shards"] = value
    with pytest.raises(InputError, match=match) as e:
        check_config(cfg, source="my.yaml")
    assert "score.shards" in str(e.value) and "my.yaml" in str(e.value)
    cfg["score"]["shards"] = 200  # the smallest pool of the smoke config (the testbed's)
    check_config(cfg)


def test_workflow_plans_one_warmup_and_n_shard_jobs(tmp_path):
    """`snakemake -n` of one score run with score.shards = 2 (the DAG only)."""
    from test_workflow import planned_rules

    cfg = yaml.safe_load((ROOT / ".test" / "config.yaml").read_text())
    cfg["score"]["shards"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    plan = planned_rules(work, "results/score/skills/tiny/s0/targets.npy", configfile=path)
    assert plan["score_warmup"] == 1 and plan["score_shard"] == 2 and plan["score"] == 1
    one = planned_rules(work, "results/score/skills/tiny/s0/targets.npy",
                        configfile=ROOT / ".test" / "config.yaml")
    assert "score_warmup" not in one and "score_shard" not in one and one["score"] == 1
    shutil.rmtree(work)
