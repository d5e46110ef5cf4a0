"""LESS's warm-up checkpoints (lr-weighted, concatenated features) and S2L's loss
trajectories, on the tiny real Llama (conftest fixtures)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from test_score import FAST, _fresh, _hand_features, _hf_losses

from clusterft.pipeline.errors import InputError
from clusterft.modeling.lora import add_lora
from clusterft.modeling.optim import lr_lambda
from clusterft.pipeline.provenance import sidecar_path
from clusterft.stages.score import (Checkpoints, checkpoint_ends, compute_features_info, loss_steps,
                             merge_cfg, pool_scores, run_score, warmup_lora)
from clusterft.modeling.tokenize import encode_example


# The tiny models run several times faster on 1 thread than on 2 shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from clusterft.modeling.hf import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _run(tiny_model_dir, tok, pool, cfg, ckpt=None):
    return compute_features_info(_fresh(tiny_model_dir), tok, pool, cfg, seed=0, ckpt=ckpt)


def test_segments_and_loss_steps():
    assert checkpoint_ends(4, 1) == [4] and checkpoint_ends(4, 2) == [2, 4]
    assert checkpoint_ends(10, 3) == [3, 6, 10]
    assert loss_steps(4, 5) == [0, 1, 2, 3, 4] and loss_steps(10, 4) == [0, 3, 7, 10]
    assert loss_steps(2, 5) == [0, 1, 1, 2, 2] and loss_steps(0, 3) == [0, 0, 0]
    assert merge_cfg(None)["warmup_checkpoints"] == 1 and merge_cfg(None)["loss_points"] == 5


@pytest.mark.parametrize("bad,field", [
    ({"warmup_checkpoints": 0}, "score.warmup_checkpoints"),
    ({"warmup_checkpoints": 5, "warmup_steps": 4}, "score.warmup_checkpoints"),
    ({"warmup_checkpoints": 2, "warmup_steps": 0}, "score.warmup_checkpoints"),
    ({"warmup_checkpoints": 1.5}, "score.warmup_checkpoints"),
    ({"loss_points": 1}, "score.loss_points"),
])
def test_config_errors(bad, field):
    with pytest.raises(InputError) as e:
        merge_cfg({**FAST, **bad})
    assert e.value.field == field


def test_more_checkpoints_than_epoch_steps_refused(tiny_model_dir, tok, tiny_pool):
    cfg = {**FAST, "warmup_steps": None, "warmup_epochs": 1, "warmup_checkpoints": 3}
    with pytest.raises(InputError, match="3 warm-up checkpoints") as e:  # 16 / 8 = 2 steps
        _run(tiny_model_dir, tok, tiny_pool, cfg)
    assert e.value.field == "score.warmup_checkpoints"


@pytest.mark.parametrize("gradient_type", ["sgd", "adam"])
def test_two_checkpoints_concatenate_lr_weighted(tiny_model_dir, tok, tiny_pool, gradient_type):
    pool = list(tiny_pool[:16])
    cfg = {**FAST, "gradient_type": gradient_type}
    f1, s1, n1, i1 = _run(tiny_model_dir, tok, pool, {**cfg, "warmup_checkpoints": 1})
    d1, *_ = _run(tiny_model_dir, tok, pool, cfg)
    np.testing.assert_array_equal(f1, d1)  # 1 checkpoint: the default, as before
    f2, s2, n2, i2 = _run(tiny_model_dir, tok, pool, {**cfg, "warmup_checkpoints": 2})
    assert f2.shape == (16, 128) and f2.dtype == np.float32 and i2["dim"] == 128
    np.testing.assert_allclose(np.linalg.norm(f2, axis=1), 1.0, rtol=1e-5)
    # Weights: each half's mean lr (LESS's linear schedule over 4 steps, 1 warm-up step).
    assert i2["checkpoint_steps"] == [2, 4]
    lam = lr_lambda("linear", 1, 4, 0.0)
    means = [np.mean([lam(0), lam(1)]), np.mean([lam(2), lam(3)])]  # 1 and 1/2
    w = [m / sum(means) for m in means]
    np.testing.assert_allclose(i2["checkpoint_weights"], w, rtol=1e-6)
    assert i2["warmup_losses"] == i1["warmup_losses"]  # the same warm-up, observed twice
    # Per-checkpoint rows, computed independently.
    early, _, _ = _hand_features(tiny_model_dir, tok, pool, {**cfg, "warmup_checkpoints": 2},
                                 checkpoint=0)
    late = f1  # the last checkpoint is the end of the same warm-up
    np.testing.assert_allclose(f2[:, :64], np.sqrt(w[0]) * early, atol=1e-6)
    np.testing.assert_allclose(f2[:, 64:], np.sqrt(w[1]) * late, atol=1e-6)
    assert not np.allclose(early, late, atol=1e-2)
    # The cosine of two rows is the lr-weighted sum of the per-checkpoint cosines.
    np.testing.assert_allclose(f2 @ f2.T, w[0] * (early @ early.T) + w[1] * (late @ late.T),
                               atol=1e-5)
    np.testing.assert_allclose(s2, w[0] * pool_scores(early) + w[1] * pool_scores(late),
                               atol=1e-5)
    np.testing.assert_array_equal(n2, n1)  # grad_norm: the last checkpoint's


def _base_losses(tiny_model_dir, tok, pool):
    return _hf_losses(_fresh(tiny_model_dir).eval(), tok, pool)


def test_loss_trajectories(tiny_model_dir, tok, tiny_pool):
    pool = list(tiny_pool[:16])
    f5, s5, n5, i5 = _run(tiny_model_dir, tok, pool, FAST)  # loss_points 5 (default)
    traj = i5["loss_trajectories"]
    assert traj.shape == (16, 5) and traj.dtype == np.float32 and np.isfinite(traj).all()
    # Step 0: the base model (no LoRA), each example alone.
    np.testing.assert_allclose(traj[:, 0], _base_losses(tiny_model_dir, tok, pool), rtol=1e-5)
    # Last step: the warmed-up adapters (the same warm-up run by hand), each example alone.
    cfg = merge_cfg(FAST)
    pm = add_lora(_fresh(tiny_model_dir), cfg["lora"], "score.lora", 0)
    enc = [encode_example(tok, r["messages"], 64) for r in pool]
    warmup_lora(pm, enc, cfg, 0, pad_id=tok.pad_token_id)
    np.testing.assert_allclose(traj[:, -1], _hf_losses(pm.eval(), tok, pool), rtol=1e-5)
    assert not np.allclose(traj[:, 0], traj[:, -1], rtol=1e-3)
    # Measuring does not change the warm-up: the same features with 2 points as with 5.
    f2, s2, n2, i2 = _run(tiny_model_dir, tok, pool, {**FAST, "loss_points": 2})
    np.testing.assert_array_equal(f2, f5)
    np.testing.assert_array_equal(s2, s5)
    np.testing.assert_array_equal(n2, n5)
    assert i2["warmup_losses"] == i5["warmup_losses"]
    assert i2["loss_trajectories"].shape == (16, 2)
    np.testing.assert_array_equal(i2["loss_trajectories"], traj[:, [0, 4]])


def test_loss_trajectories_without_warmup(tiny_model_dir, tok, tiny_pool, caplog):
    pool = list(tiny_pool[:12])
    with caplog.at_level(logging.WARNING, logger="clusterft.stages.score"):
        _, _, _, info = _run(tiny_model_dir, tok, pool, {**FAST, "warmup_steps": 0,
                                                          "loss_points": 3})
    traj = info["loss_trajectories"]
    assert traj.shape == (12, 3)
    np.testing.assert_array_equal(traj, traj[:, :1].repeat(3, axis=1))
    np.testing.assert_allclose(traj[:, 0], _base_losses(tiny_model_dir, tok, pool), rtol=1e-5)
    assert "base model's loss" in caplog.text


class Killed(Exception):
    pass


class KillingCheckpoints(Checkpoints):
    """Raises right after the ``count``-th save of ``name``: a run killed at that point."""

    def __init__(self, folder, fingerprint, name, count):
        super().__init__(folder, fingerprint)
        self.name, self.count = name, count

    def save(self, name, blob):
        super().save(name, blob)
        if name == self.name:
            self.count -= 1
            if self.count == 0:
                raise Killed(name)


@pytest.mark.parametrize("name,count,where", [
    ("warmup.pt", 1, None),                            # after warm-up checkpoint 1 of 2
    ("gradients.pt", 1, {"checkpoint": 0, "row": 8}),  # inside checkpoint 1's pass
    ("gradients.pt", 2, {"checkpoint": 1, "row": 0}),  # between the two passes
    ("gradients.pt", 3, {"checkpoint": 1, "row": 8}),  # inside checkpoint 2's pass
])
def test_resume_between_checkpoints(tmp_path, tiny_model_dir, tok, tiny_pool, name, count,
                                    where):
    pool = list(tiny_pool[:16])
    cfg = {**FAST, "warmup_checkpoints": 2, "checkpoint_every": 1, "gradient_type": "adam",
           "lora": {**FAST["lora"], "dropout": 0.1}}  # dropout: the RNG must resume too
    ref = _run(tiny_model_dir, tok, pool, cfg)
    with pytest.raises(Killed):
        _run(tiny_model_dir, tok, pool, cfg, KillingCheckpoints(tmp_path, "fp", name, count))
    if name == "warmup.pt":
        blob = torch.load(tmp_path / "warmup.pt", weights_only=False)
        assert [c["step"] for c in blob["info"]["checkpoints"]] == [2]
        assert blob["state"]["step"] == 2
    f, s, n, info = _run(tiny_model_dir, tok, pool, cfg, Checkpoints(tmp_path, "fp"))
    assert info["warmup_resumed"] and info["gradients_resumed_at"] == where
    np.testing.assert_array_equal(f, ref[0])
    np.testing.assert_array_equal(s, ref[1])
    np.testing.assert_array_equal(n, ref[2])
    np.testing.assert_array_equal(info["loss_trajectories"], ref[3]["loss_trajectories"])
    assert info["warmup_losses"] == ref[3]["warmup_losses"]


def test_run_score_writes_trajectories(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool):
    out = tmp_path / "s"
    cfg = {**FAST, "dim": 16, "warmup_checkpoints": 2, "loss_points": 3}
    info = run_score(tiny_model_dir, tiny_pool_path, cfg, out / "features.npy",
                     out / "scores.parquet", seed=0, threads=1,
                     out_trajectories=out / "trajectories.npy")
    f, t = np.load(out / "features.npy"), np.load(out / "trajectories.npy")
    assert f.shape == (len(tiny_pool), 32) and t.shape == (len(tiny_pool), 3)
    assert t.dtype == np.float32 and np.isfinite(t).all()
    assert "loss_trajectories" not in info and info["checkpoint_steps"] == [2, 4]
    side = {k: json.loads(sidecar_path(out / f"{k}.{ext}").read_text())
            for k, ext in (("features", "npy"), ("trajectories", "npy"))}
    assert side["trajectories"]["output"] == "trajectories"
    assert side["trajectories"]["lineage"]["score_run"] == side["features"]["lineage"]["score_run"]
    assert side["features"]["config"]["warmup_checkpoints"] == 2
    assert not (out / "features.npy.ckpt").exists()
