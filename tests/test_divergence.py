"""Numbers that blow up stop loudly: a learning rate that diverges on the real tiny model
stops pretraining, the scoring warm-up and fine-tuning at the step where the loss or the
gradient norm stops being finite, naming the step, the run and the key to change, before
anything is written as complete; cluster refuses features with NaN rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clusterft.pipeline.errors import InputError
from clusterft.modeling.optim import DivergedError, check_finite

from conftest import TINY_SIZE
from test_train import make_selection

DIVERGING_LR = 1.0e10


def test_finite_values_pass_and_non_finite_ones_name_everything() -> None:
    check_finite(2.5, 0.7, step=3, total=10, run="r", lr_field="train.lr", lr=1e-3)
    with pytest.raises(DivergedError, match=r"r: gradient norm inf at step 3 of 10.*train\.lr "
                                            r"\(now 0\.001\).*ckpt/x\) is kept") as e:
        check_finite(2.5, float("inf"), step=3, total=10, run="r", lr_field="train.lr", lr=1e-3,
                     checkpoint="ckpt/x")
    assert isinstance(e.value, InputError) and e.value.field == "train.lr"


def test_pretraining_stops_and_writes_no_base_model(tmp_path, tiny_tokenizer_dir, tiny_corpus_path):
    from clusterft.stages.models import run_model

    out = tmp_path / "base"
    cfg = {"source": "build", "size": TINY_SIZE,
           "pretrain": {"steps": 30, "block_size": 64, "batch_size": 8, "lr": DIVERGING_LR,
                        "warmup_steps": 0, "val_fraction": 0.0}}
    with pytest.raises(DivergedError, match=r"pretraining \(models\.tiny\.pretrain\): loss nan.* "
                                            r"at step \d+ of 30.*Lower models\.tiny\.pretrain\.lr") as e:
        run_model(tiny_tokenizer_dir, tiny_corpus_path, cfg, out, name="tiny")
    assert e.value.field == "models.tiny.pretrain.lr"
    assert not out.exists()  # nothing half-written looks like a base model


@pytest.mark.parametrize("lr, message", [
    (1.0e20, r"score warm-up: loss nan at step \d+ of 20: training diverged\. Lower "
             r"score\.warmup_lr \(now 1e\+20\)"),
    # a smaller blow-up saturates the model instead: finite losses, zero gradients
    (1.0e6, r"zero gradient for \d+ of 64 examples \(ids \['tiny-.*lower score\.warmup_lr"),
])
def test_scoring_warm_up_stops(tmp_path, tiny_model_dir, tiny_pool_path, lr, message):
    from clusterft.stages.score import run_score

    feats, scores = tmp_path / "features.npy", tmp_path / "scores.parquet"
    cfg = {"dim": 16, "warmup_steps": 20, "warmup_fraction": 0.5, "warmup_lr": lr}
    with pytest.raises(DivergedError, match=message) as e:
        run_score(tiny_model_dir, tiny_pool_path, cfg, feats, scores, seed=0)
    assert e.value.field == "score.warmup_lr"
    assert not feats.exists() and not scores.exists()


def test_training_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model_dir, tiny_pool,
                                                           tiny_pool_path):
    import torch

    from clusterft.stages.train import run_train

    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 32)
    out, metrics = tmp_path / "model", tmp_path / "train_metrics.json"
    cfg = {"batch_size": 4, "epochs": 1, "max_length": 64, "lr": DIVERGING_LR,
           "warmup_ratio": 0.0, "checkpoint_every": 1}
    with pytest.raises(DivergedError, match=r"train .*model: (loss|gradient norm) nan.*at step "
                                            r"(\d+) of 8.*Lower train\.lr.*model\.ckpt\) is kept") as e:
        run_train(tiny_model_dir, tiny_pool_path, sel, out, metrics, "balanced", 0, cfg)
    step = int(str(e.value).split(" at step ")[1].split()[0])
    assert step >= 2  # the first step's loss is the base model's, finite
    assert not out.exists() and not metrics.exists()
    blob = torch.load(tmp_path / "model.ckpt" / "state.pt", weights_only=False)
    assert blob["step"] == step - 1  # the last step whose gradient was finite
    assert all(torch.isfinite(v).all() for v in blob["model"].values() if v.is_floating_point())
    assert all(np.isfinite(blob["acc"]["losses"]))


def test_cluster_refuses_features_with_nan_rows(tmp_path):
    from clusterft.stages.cluster import run_cluster
    from clusterft.pipeline.io import save_npy, write_parquet

    x = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    x[[3, 11]] = np.nan
    save_npy(tmp_path / "f.npy", x)
    write_parquet(tmp_path / "s.parquet", pd.DataFrame({"id": [f"e{i}" for i in range(20)],
                                                        "score": 0.0}))
    with pytest.raises(InputError, match=r"f\.npy.*2 rows hold NaN or infinite values \(rows "
                                         r"\[3, 11\]\).*rerun score"):
        run_cluster(tmp_path / "f.npy", tmp_path / "s.parquet", {"k": 2}, tmp_path / "c.parquet",
                    tmp_path / "c.npy")
    assert not (tmp_path / "c.parquet").exists()


def test_two_ranks_stop_together_with_the_error(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """Every rank sees the same summed gradient norm, so both stop at the same step (no hang)
    and the job exits with the named error (exit 2), writing no model."""
    from test_train import torchrun

    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 32)
    out, met = tmp_path / "model", tmp_path / "m.json"
    cfg = {"global_batch_size": 4, "epochs": 1, "max_length": 64, "lr": DIVERGING_LR,
           "warmup_ratio": 0.0}
    r = torchrun(2, tiny_model_dir, tiny_pool_path, sel, out, met, "balanced", 0, cfg, tmp_path)
    assert r.returncode != 0
    import re

    steps = re.findall(r"error: field 'train\.lr': .*? at step (\d+) of 8: training diverged",
                       r.stderr)
    assert len(steps) == 2 and len(set(steps)) == 1, r.stderr[-3000:]  # both ranks, one step
    assert "Lower train.lr" in r.stderr
    assert not out.exists() and not met.exists()
