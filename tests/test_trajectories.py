"""Loss-trajectory features (S2L): centred, unit rows; the file edge and its refusals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clusterft.pipeline.errors import InputError
from clusterft.stages.features.trajectories import loss_trajectory_features, run_loss_features


def test_rows_are_centred_unit_directions():
    t = np.array([[3.0, 2.0, 1.0], [3.0, 2.5, 2.0], [2.0, 1.0, 0.5], [4.0, 3.0, 2.5]])
    f = loss_trajectory_features(t)
    assert f.dtype == np.float32 and f.shape == t.shape
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-6)
    c = t - t.mean(0)
    np.testing.assert_allclose(f, c / np.linalg.norm(c, axis=1, keepdims=True), rtol=1e-6)
    # the same shift in every example's loss changes nothing: only deviations count
    np.testing.assert_allclose(loss_trajectory_features(t + 5.0), f, rtol=1e-5)


def test_learners_and_non_learners_separate_under_cosine_kmeans():
    from clusterft.stages.cluster import cosine_kmeans

    rng = np.random.default_rng(0)
    steps = np.linspace(0, 1, 5)
    learn = 3.0 - 2.0 * steps + rng.normal(0, 0.05, (30, 5))  # loss falls
    stuck = 3.0 - 0.1 * steps + rng.normal(0, 0.05, (30, 5))  # loss stays
    labels, _ = cosine_kmeans(loss_trajectory_features(np.vstack([learn, stuck])), 2, seed=0)
    assert len(set(labels[:30])) == 1 and len(set(labels[30:])) == 1 and labels[0] != labels[30]


def test_refusals_name_the_problem():
    with pytest.raises(InputError, match="NaN or inf"):
        loss_trajectory_features(np.array([[1.0, np.nan], [1.0, 2.0]]))
    with pytest.raises(InputError, match=r"mean trajectory \(ids \['b'\]"):
        loss_trajectory_features(np.array([[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]), ["a", "b", "c"])
    with pytest.raises(InputError, match="shape"):
        loss_trajectory_features(np.ones(4))


def test_run_loss_features_writes_score_format_and_cluster_reads_it(tmp_path):
    from clusterft.stages.cluster import run_cluster
    from clusterft.pipeline.io import save_npy, write_parquet

    rng = np.random.default_rng(1)
    ids = [f"ex-{i}" for i in range(40)]
    traj, scores = tmp_path / "trajectories.npy", tmp_path / "scores.parquet"
    save_npy(traj, (3 - np.outer(rng.uniform(0, 2, 40), np.linspace(0, 1, 5))).astype(np.float32))
    write_parquet(scores, pd.DataFrame({"id": ids, "score": 0.0, "grad_norm": 1.0}))
    out_f, out_s = tmp_path / "loss" / "features.npy", tmp_path / "loss" / "scores.parquet"
    info = run_loss_features(traj, scores, out_f, out_s)
    assert info == {"n": 40, "points": 5}
    df = pd.read_parquet(out_s)
    assert df["id"].tolist() == ids and df["grad_norm"].isna().all()
    f = np.load(out_f)
    np.testing.assert_allclose(df["score"], (f @ f.sum(0) - 1) / 39, rtol=1e-5)
    summary = run_cluster(out_f, out_s, {"k": 3, "n_init": 2}, tmp_path / "c.parquet",
                          tmp_path / "c.npy", seed=0)
    assert sum(summary["sizes"]) == 40
    write_parquet(scores, pd.DataFrame({"id": ids[:-1], "score": 0.0, "grad_norm": 1.0}))
    with pytest.raises(InputError, match="39 rows but"):
        run_loss_features(traj, scores, tmp_path / "x.npy", tmp_path / "x.parquet")
