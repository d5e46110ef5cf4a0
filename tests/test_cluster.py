"""Cosine k-means on synthetic features with known groups."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clusterft.stages.cluster import DEFAULTS, center_rows, cosine_kmeans, merge_cfg, run_cluster
from clusterft.analysis.stats import cluster_agreement
from clusterft.pipeline.errors import InputError


def blobs(sizes=(120, 60, 30, 20, 10), dim=32, noise=0.15, seed=0):
    """Unit vectors around random directions; returns (features, true labels)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), dim))
    x, y = [], []
    for c, n in enumerate(sizes):
        unit = centres[c] / np.linalg.norm(centres[c])
        x.append(unit + noise * rng.standard_normal((n, dim)) / np.sqrt(dim))
        y += [c] * n
    x = np.concatenate(x)
    perm = rng.permutation(len(x))
    x = x[perm] * rng.uniform(0.5, 3.0, size=(len(x), 1))  # scale must not matter
    return x.astype(np.float32), np.asarray(y)[perm]


def test_defaults():
    assert set(DEFAULTS) == {"k", "n_init", "max_iter", "backend", "center"}
    assert DEFAULTS["backend"] == "numpy"
    assert DEFAULTS["center"] is False  # docs/method_choices.md


def test_recovers_separated_clusters():
    x, y = blobs()
    labels, centroids = cosine_kmeans(x, 5, seed=0, n_init=5, max_iter=50)
    assert labels.shape == (240,) and labels.dtype == np.int64
    assert centroids.shape == (5, 32) and centroids.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, rtol=1e-5)
    agree = cluster_agreement(labels, y)
    assert agree["ari"] > 0.95 and agree["nmi"] > 0.95 and agree["purity"] > 0.97
    sizes = np.bincount(labels)
    assert list(sizes) == sorted(sizes, reverse=True) == [120, 60, 30, 20, 10]
    # Each row is assigned to its most similar centroid.
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_array_equal((unit @ centroids.T).argmax(1), labels)


def test_deterministic_and_scale_invariant():
    x, _ = blobs(sizes=(50, 40, 30, 20), noise=0.8, seed=1)  # overlapping: init matters
    a = cosine_kmeans(x, 6, seed=3, n_init=3)
    b = cosine_kmeans(x, 6, seed=3, n_init=3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = cosine_kmeans(x * 7.0, 6, seed=3, n_init=3)
    np.testing.assert_array_equal(a[0], c[0])


def test_restarts_pick_best_objective():
    x, _ = blobs(sizes=(40,) * 8, noise=0.9, seed=2)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)

    def objective(labels, centroids):
        return float((unit * centroids[labels]).sum())

    single = objective(*cosine_kmeans(x, 8, seed=0, n_init=1))
    multi = objective(*cosine_kmeans(x, 8, seed=0, n_init=6))  # its first init is `single`'s
    assert multi >= single - 1e-9
    # The restarts really differ on overlapping data, so keeping the best one matters.
    objs = {round(objective(*cosine_kmeans(x, 8, seed=s, n_init=1)), 6) for s in range(6)}
    assert len(objs) > 1


def test_duplicates_and_empty_clusters():
    rng = np.random.default_rng(0)
    dirs = rng.standard_normal((3, 8))
    x = np.repeat(dirs, [20, 5, 1], axis=0)
    labels, _ = cosine_kmeans(x, 3, seed=0, n_init=2)
    assert cluster_agreement(labels, np.repeat([0, 1, 2], [20, 5, 1]))["ari"] == pytest.approx(1.0)
    with pytest.raises(InputError, match="distinct"):
        cosine_kmeans(x, 4, seed=0)


def test_k_one_and_errors():
    x, _ = blobs(sizes=(5, 5))
    labels, centroids = cosine_kmeans(x, 1, seed=0)
    assert set(labels) == {0} and centroids.shape == (1, 32)
    with pytest.raises(InputError, match="k = 11 clusters asked for only 10 examples"):
        cosine_kmeans(x, 11, seed=0)
    bad = x.copy()
    bad[3] = 0
    with pytest.raises(InputError, match=r"rows \[3\]"):
        cosine_kmeans(bad, 2, seed=0)
    bad[3] = np.nan
    with pytest.raises(InputError, match="NaN"):
        cosine_kmeans(bad, 2, seed=0)


def test_cluster_agreement_values():
    y = np.array([0, 0, 1, 1, 2, 2])
    perfect = cluster_agreement(np.array([5, 5, 3, 3, 9, 9]), y)
    assert perfect["ari"] == pytest.approx(1) and perfect["nmi"] == pytest.approx(1)
    assert perfect["purity"] == 1.0
    merged = cluster_agreement(np.array([0, 0, 0, 0, 1, 1]), y)
    assert merged["purity"] == pytest.approx(4 / 6) and merged["ari"] < 1
    rng = np.random.default_rng(0)
    yy = rng.integers(0, 4, 2000)
    assert abs(cluster_agreement(rng.integers(0, 4, 2000), yy)["ari"]) < 0.02
    with pytest.raises(ValueError):
        cluster_agreement(np.zeros(3), np.zeros(4))


def _write_inputs(tmp_path, x):
    from clusterft.pipeline.io import save_npy, write_parquet

    ids = [f"ex-{i}" for i in range(len(x))]
    save_npy(tmp_path / "features.npy", x)
    write_parquet(tmp_path / "scores.parquet",
                  pd.DataFrame({"id": ids, "score": np.zeros(len(x)), "grad_norm": np.ones(len(x))}))
    return ids


def test_run_cluster_files(tmp_path):
    x, y = blobs()
    ids = _write_inputs(tmp_path, x)
    out_c, out_m = tmp_path / "c" / "clusters.parquet", tmp_path / "c" / "centroids.npy"
    summary = run_cluster(tmp_path / "features.npy", tmp_path / "scores.parquet",
                          {"k": 5, "n_init": 3}, out_c, out_m, seed=0)
    df = pd.read_parquet(out_c)
    assert list(df.columns) == ["id", "cluster", "centroid_sim"]
    assert df["id"].tolist() == ids
    assert cluster_agreement(df["cluster"].to_numpy(), y)["ari"] > 0.95
    assert np.load(out_m).shape == (5, 32)
    assert summary["sizes"] == [120, 60, 30, 20, 10]
    assert ((df["centroid_sim"] > 0.5) & (df["centroid_sim"] <= 1 + 1e-9)).all()


def test_run_cluster_errors(tmp_path):
    x, _ = blobs(sizes=(4, 4))
    _write_inputs(tmp_path, x)
    f, s = tmp_path / "features.npy", tmp_path / "scores.parquet"
    with pytest.raises(InputError, match=r"features\.npy.*cluster\.k.*k = 9"):
        run_cluster(f, s, {"k": 9}, tmp_path / "c.parquet", tmp_path / "m.npy")
    assert not (tmp_path / "c.parquet").exists()
    with pytest.raises(InputError, match="unknown key"):
        run_cluster(f, s, {"kk": 2}, tmp_path / "c.parquet", tmp_path / "m.npy")
    from clusterft.pipeline.io import save_npy

    save_npy(f, x[:5])
    with pytest.raises(InputError, match="8 rows but features.npy has 5"):
        run_cluster(f, s, {"k": 2}, tmp_path / "c.parquet", tmp_path / "m.npy")
    with pytest.raises(InputError, match="does not exist"):
        run_cluster(tmp_path / "nope.npy", s, {"k": 2}, tmp_path / "c.parquet", tmp_path / "m.npy")


def test_gradient_features_of_tiny_model_carry_skill_signal(tiny_model_dir, tiny_pool,
                                                            tiny_pool_labels):
    """End to end on the real tiny model: clusters of gradient features beat chance."""
    import torch
    from transformers import AutoModelForCausalLM

    from clusterft.modeling.hf import load_tokenizer
    from clusterft.stages.score import compute_features

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    feats, _, _ = compute_features(model, tok, tiny_pool, {"dim": 64}, seed=0)
    labels, _ = cosine_kmeans(feats, 4, seed=0)
    truth = [tiny_pool_labels[r["id"]] for r in tiny_pool]
    agree = cluster_agreement(labels, truth)
    shuffled = cluster_agreement(np.random.default_rng(0).permutation(labels), truth)
    assert agree["ari"] > 0.15 > shuffled["ari"], (agree, shuffled)


# --- backend: faiss (faiss.Kmeans(spherical=True)) against the numpy reference ------------

@pytest.fixture
def faiss():
    """The faiss module (a pinned dependency); the faiss tests skip where it is missing."""
    return pytest.importorskip("faiss")


def _objective(x, labels, centroids):
    """Total cosine of the rows with their centroids (what both backends maximise)."""
    unit = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return float((unit * centroids.astype(np.float64)[labels]).sum())


def test_faiss_equals_numpy_on_separated_clusters(faiss):
    x, y = blobs(sizes=(50,) * 6, dim=16, noise=0.1, seed=0)  # 6 x 50 points in 16-d
    ref = cosine_kmeans(x, 6, seed=0, n_init=3)
    got = cosine_kmeans(x, 6, seed=0, n_init=3, backend="faiss")
    assert got[0].dtype == np.int64 and got[1].dtype == np.float32 and got[1].shape == (6, 16)
    assert cluster_agreement(got[0], y)["ari"] == pytest.approx(1.0)
    # Canonical numbering (size, then first row): the same partition gives the same ids.
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got[1], axis=1), 1.0, rtol=1e-5)
    # Unequal sizes: ids by decreasing size, as the reference numbers them.
    x, _ = blobs(seed=0)
    got = cosine_kmeans(x, 5, seed=0, n_init=3, backend="faiss")
    np.testing.assert_array_equal(got[0], cosine_kmeans(x, 5, seed=0, n_init=3)[0])
    assert np.bincount(got[0]).tolist() == [120, 60, 30, 20, 10]


def test_faiss_objective_close_to_numpy_on_noisy_data(faiss):
    # Overlapping clusters: the two backends' seeding draws differ, so they may stop in
    # different local optima; their total cosine objective agrees within 0.1% relative
    # (measured: at most 1e-5 on this data for these seeds).
    x, _ = blobs(sizes=(40,) * 8, dim=16, noise=1.0, seed=3)
    for seed in range(3):
        ref = _objective(x, *cosine_kmeans(x, 8, seed=seed, n_init=5))
        got = _objective(x, *cosine_kmeans(x, 8, seed=seed, n_init=5, backend="faiss"))
        assert abs(got - ref) <= 1e-3 * abs(ref), (seed, got, ref)


def test_faiss_deterministic_by_seed_and_restores_threads(faiss):
    x, _ = blobs(sizes=(50, 40, 30, 20), noise=0.8, seed=1)
    threads = faiss.omp_get_max_threads()
    a = cosine_kmeans(x, 6, seed=3, n_init=3, backend="faiss")
    assert faiss.omp_get_max_threads() == threads
    b = cosine_kmeans(x, 6, seed=3, n_init=3, backend="faiss")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], cosine_kmeans(x * 7.0, 6, seed=3, n_init=3,
                                                      backend="faiss")[0])
    # Every cluster non-empty, ids numbered by decreasing size.
    sizes = np.bincount(a[0], minlength=6)
    assert sizes.min() >= 1 and list(sizes) == sorted(sizes, reverse=True)
    with pytest.raises(InputError, match="distinct"):
        cosine_kmeans(np.repeat(x[:3], 5, axis=0), 4, seed=0, backend="faiss")


def test_backend_validation(monkeypatch, faiss):
    from clusterft.stages.cluster import merge_cfg

    assert merge_cfg({"backend": "faiss"})["backend"] == "faiss"
    with pytest.raises(InputError, match="cluster.backend.*unknown backend 'sklearn'") as e:
        merge_cfg({"backend": "sklearn"})
    assert e.value.field == "cluster.backend"
    x, _ = blobs(sizes=(5, 5))
    with pytest.raises(InputError, match="unknown backend") as e:
        cosine_kmeans(x, 2, backend="FAISS")
    assert e.value.field == "cluster.backend"
    monkeypatch.setitem(__import__("sys").modules, "faiss", None)  # faiss not importable
    with pytest.raises(InputError, match="needs the faiss-cpu package") as e:
        merge_cfg({"backend": "faiss"})
    assert e.value.field == "cluster.backend"


def test_run_cluster_faiss_same_files(tmp_path, faiss):
    x, y = blobs()
    ids = _write_inputs(tmp_path, x)
    out = {}
    for backend in ("numpy", "faiss"):
        out_c, out_m = tmp_path / backend / "clusters.parquet", tmp_path / backend / "centroids.npy"
        summary = run_cluster(tmp_path / "features.npy", tmp_path / "scores.parquet",
                              {"k": 5, "n_init": 3, "backend": backend}, out_c, out_m, seed=0)
        out[backend] = (pd.read_parquet(out_c), np.load(out_m), summary)
    (df_n, m_n, s_n), (df_f, m_f, s_f) = out["numpy"], out["faiss"]
    assert list(df_f.columns) == ["id", "cluster", "centroid_sim"] and df_f["id"].tolist() == ids
    assert df_f.dtypes.equals(df_n.dtypes)
    assert m_f.dtype == m_n.dtype == np.float32 and m_f.shape == m_n.shape == (5, 32)
    np.testing.assert_array_equal(df_f["cluster"], df_n["cluster"])
    np.testing.assert_allclose(df_f["centroid_sim"], df_n["centroid_sim"], atol=1e-5)
    assert s_f["sizes"] == s_n["sizes"] == [120, 60, 30, 20, 10]


def test_center_changes_nothing_for_centred_data():
    x, y = blobs(sizes=(60, 50, 40), noise=0.5, seed=4)
    xc = x - x.mean(0)
    np.testing.assert_allclose(center_rows(xc), xc, atol=1e-5)
    a = cosine_kmeans(xc, 3, seed=0, n_init=3)
    b = cosine_kmeans(center_rows(xc), 3, seed=0, n_init=3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)


def test_center_separates_groups_that_differ_along_the_shared_direction(tmp_path):
    """Two groups on one ray (1 u and 3 u, plus small noise): the same direction, so
    cosine k-means cannot tell them apart, until the mean row (2 u) is subtracted."""
    rng = np.random.default_rng(0)
    u = rng.standard_normal(16)
    u /= np.linalg.norm(u)
    y = np.repeat([0, 1], 50)
    x = (np.where(y == 0, 1.0, 3.0)[:, None] * u + 0.05 * rng.standard_normal((100, 16)))
    plain = cosine_kmeans(x, 2, seed=0)[0]
    centred = cosine_kmeans(center_rows(x), 2, seed=0)[0]
    assert cluster_agreement(plain, y)["ari"] < 0.2
    assert cluster_agreement(centred, y)["ari"] == 1.0
    # run_cluster with center: true clusters the centred rows
    ids = [f"e{i}" for i in range(100)]
    np.save(tmp_path / "f.npy", x.astype(np.float32))
    pd.DataFrame({"id": ids, "score": np.zeros(100)}).to_parquet(tmp_path / "s.parquet")
    for center, want in ((False, plain), (True, centred)):
        out = tmp_path / f"c{center}"
        run_cluster(tmp_path / "f.npy", tmp_path / "s.parquet",
                    {"k": 2, "center": center, "n_init": 10}, str(out) + ".parquet",
                    str(out) + ".npy", seed=0)
        got = pd.read_parquet(str(out) + ".parquet")["cluster"].to_numpy()
        assert cluster_agreement(got, want)["ari"] == 1.0
    with pytest.raises(InputError, match="cluster.center"):
        merge_cfg({"center": "yes"})
