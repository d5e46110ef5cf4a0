"""Budgeted selection: sizes, per-cluster quotas, determinism, errors, files."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterft.pipeline.errors import InputError
from clusterft.stages.select import DEFAULTS, cluster_quotas, n_select, run_select, select

sizes_st = st.lists(st.integers(1, 60), min_size=1, max_size=12)


def pool(sizes=(50, 20, 8, 2), seed=0):
    """ids, shuffled cluster labels, scores."""
    rng = np.random.default_rng(seed)
    clusters = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    ids = np.array([f"ex-{i:03d}" for i in range(len(clusters))])
    return ids, clusters, rng.standard_normal(len(clusters))


def test_defaults():
    assert DEFAULTS == {"quota": "uniform", "within": "random", "less_agg": "max"}


@pytest.mark.parametrize("n,budget,expected", [(10, 0.25, 3), (10, 0.24, 2), (3000, 0.31, 930),
                                               (7, 1.0, 7), (7, 0.01, 1)])
def test_n_select(n, budget, expected):
    assert n_select(n, budget) == expected


def test_quota_examples():
    assert cluster_quotas([100, 10, 1], 30, "uniform").tolist() == [19, 10, 1]
    assert cluster_quotas([100, 10, 1], 30, "proportional").tolist() == [26, 3, 1]
    sq = cluster_quotas([100, 10, 1], 30, "sqrt").tolist()
    assert sq[2] == 1 and 19 <= sq[0] <= 26 and sum(sq) == 30
    assert cluster_quotas([10, 10, 1], 10, "uniform").tolist() == [5, 4, 1]  # tie -> lower id
    assert cluster_quotas([5, 4, 3], 12, "sqrt").tolist() == [5, 4, 3]  # whole pool
    # Fewer slots than clusters: the largest clusters win, no forced minimum.
    assert cluster_quotas([9, 8, 7, 6], 2, "uniform").tolist() == [1, 1, 0, 0]
    assert cluster_quotas([9, 8, 7, 6], 2, "proportional").tolist() == [1, 1, 0, 0]


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, frac=st.floats(0.0, 1.0), quota=st.sampled_from(["uniform", "proportional", "sqrt"]))
def test_quota_invariants(sizes, frac, quota):
    total = int(round(frac * sum(sizes)))
    q = cluster_quotas(sizes, total, quota)
    s = np.asarray(sizes)
    assert q.sum() == total
    assert np.all(q >= 0) and np.all(q <= s)
    if total >= len(sizes):
        assert np.all(q >= 1)
    # Monotone: a larger cluster never gets fewer than a smaller one.
    for i in range(len(s)):
        for j in range(len(s)):
            if s[i] > s[j]:
                assert q[i] >= q[j], (sizes, total, quota, q)
    if quota == "uniform":
        # Water-filling: nobody gets more than one above a cluster that is not full.
        for i in np.flatnonzero(q < s):
            assert q.max() <= q[i] + 1, (sizes, total, q)
    if quota == "proportional" and total >= len(sizes):
        ideal = total * s / s.sum()
        big = ideal >= 1
        if big.all():
            assert np.all(np.abs(q - ideal) < 1), (sizes, total, q)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(2, 60), min_size=2, max_size=10), frac=st.floats(0.05, 0.95))
def test_sqrt_between_uniform_and_proportional(sizes, frac):
    total = max(len(sizes), int(round(frac * sum(sizes))))
    big = int(np.argmax(sizes))
    u, p, r = (cluster_quotas(sizes, total, q)[big] for q in ("uniform", "proportional", "sqrt"))
    assert u - 1 <= r <= p + 1


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.31, 0.5, 0.99, 1.0])
@pytest.mark.parametrize("quota", ["uniform", "proportional", "sqrt"])
def test_cluster_exact_size_and_coverage(budget, quota):
    ids, clusters, scores = pool()
    idx = select(ids, clusters, scores, "cluster", budget, {"quota": quota}, seed=0)
    assert len(idx) == n_select(len(ids), budget)
    assert np.all(np.diff(idx) > 0)  # sorted, unique
    assert set(clusters[idx]) == set(clusters)  # 80 * 0.05 = 4 >= k: every cluster kept
    counts = np.bincount(clusters[idx], minlength=4)
    np.testing.assert_array_equal(counts, cluster_quotas([50, 20, 8, 2], len(idx), quota))


def test_uniform_balances_more_than_random():
    ids, clusters, scores = pool()
    idx = select(ids, clusters, scores, "cluster", 0.25, {"quota": "uniform"}, seed=0)
    assert np.bincount(clusters[idx]).tolist() == [6, 6, 6, 2]
    rnd = select(ids, clusters, scores, "random", 0.25, None, seed=0)
    assert len(rnd) == 20 and np.bincount(clusters[rnd], minlength=4)[0] > 6


def test_too_small_budget_covers_largest_clusters():
    ids, clusters, scores = pool()
    idx = select(ids, clusters, scores, "cluster", 0.03, None, seed=0)  # 2 slots, 4 clusters
    assert sorted(clusters[idx].tolist()) == [0, 1]


def test_within_score_and_centroid():
    ids, clusters, scores = pool()
    idx = select(ids, clusters, scores, "cluster", 0.25, {"within": "score"}, seed=0)
    for c in range(4):
        members = np.flatnonzero(clusters == c)
        chosen = idx[clusters[idx] == c]
        top = members[np.argsort(-scores[members], kind="stable")[:len(chosen)]]
        assert sorted(chosen.tolist()) == sorted(top.tolist())
    sim = -scores  # any per-row value: centroid picks the highest
    idc = select(ids, clusters, scores, "cluster", 0.25, {"within": "centroid"}, seed=0,
                 centroid_sim=sim)
    low = select(ids, clusters, -scores, "cluster", 0.25, {"within": "score"}, seed=0)
    np.testing.assert_array_equal(idc, low)
    with pytest.raises(InputError, match="centroid_sim"):
        select(ids, clusters, scores, "cluster", 0.25, {"within": "centroid"}, seed=0)


def test_deterministic_by_seed_and_full():
    ids, clusters, scores = pool()
    for method in ("random", "cluster"):
        a = select(ids, clusters, scores, method, 0.3, None, seed=1)
        b = select(ids, clusters, scores, method, 0.3, None, seed=1)
        c = select(ids, clusters, scores, method, 0.3, None, seed=2)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
    full = select(ids, clusters, scores, "full", 0.3, None, seed=0)
    np.testing.assert_array_equal(full, np.arange(len(ids)))


def test_cluster_picks_do_not_depend_on_other_clusters():
    ids, clusters, scores = pool()
    a = select(ids, clusters, scores, "cluster", 0.2, {"quota": "uniform"}, seed=0)
    b = select(ids, clusters, scores, "cluster", 0.2, {"quota": "sqrt"}, seed=0)
    # 16 slots: uniform [5, 5, 4, 2], sqrt [7, 5, 3, 1]; cluster 1 (size 20) gets 5 in both.
    assert np.bincount(clusters[a])[1] == np.bincount(clusters[b])[1] == 5
    np.testing.assert_array_equal(a[clusters[a] == 1], b[clusters[b] == 1])


def test_errors():
    ids, clusters, scores = pool()
    for bad in (0, -0.1, 1.5, float("nan"), "abc"):
        with pytest.raises(InputError, match=r"budget"):
            select(ids, clusters, scores, "random", bad, None, seed=0)
    with pytest.raises(InputError, match="unknown method .kcenter.; valid: full, random, cluster"):
        select(ids, clusters, scores, "kcenter", 0.5, None, seed=0)
    with pytest.raises(InputError, match="uniform, proportional, sqrt"):
        select(ids, clusters, scores, "cluster", 0.5, {"quota": "equal"}, seed=0)
    with pytest.raises(InputError, match="unknown key"):
        select(ids, clusters, scores, "cluster", 0.5, {"within_cluster": "random"}, seed=0)
    with pytest.raises(InputError, match="79 values for 80 ids"):
        select(ids, clusters[:-1], scores, "cluster", 0.5, None, seed=0)
    dup = ids.copy()
    dup[1] = dup[0]
    with pytest.raises(InputError, match="not unique"):
        select(dup, clusters, scores, "cluster", 0.5, None, seed=0)


def _files(tmp_path, ids, clusters, scores, sim=True):
    from clusterft.pipeline.io import write_parquet

    cdf = pd.DataFrame({"id": ids, "cluster": clusters})
    if sim:
        cdf["centroid_sim"] = np.linspace(0, 1, len(ids))
    write_parquet(tmp_path / "clusters.parquet", cdf)
    write_parquet(tmp_path / "scores.parquet",
                  pd.DataFrame({"id": ids, "score": scores, "grad_norm": np.ones(len(ids))}))
    return tmp_path / "clusters.parquet", tmp_path / "scores.parquet"


def test_run_select_files(tmp_path):
    ids, clusters, scores = pool()
    c, s = _files(tmp_path, ids, clusters, scores)
    out_p, out_j = tmp_path / "o" / "selection.parquet", tmp_path / "o" / "selection.json"
    summary = run_select(c, s, "cluster", 0.31, {"quota": "sqrt"}, out_p, out_j, seed=0)
    df = pd.read_parquet(out_p)
    assert list(df.columns) == ["id", "cluster", "score"]
    assert len(df) == 25 and df["id"].tolist() == sorted(df["id"].tolist())  # pool order
    pos = {v: i for i, v in enumerate(ids)}
    rows = [pos[v] for v in df["id"]]
    np.testing.assert_array_equal(df["cluster"].to_numpy(), clusters[rows])
    np.testing.assert_allclose(df["score"].to_numpy(), scores[rows])
    js = json.loads(out_j.read_text())
    assert js == summary
    assert (js["method"], js["budget"], js["seed"], js["quota"], js["within"]) == (
        "cluster", 0.31, 0, "sqrt", "random")
    assert js["n_pool"] == 80 and js["n_selected"] == 25 and js["n_clusters"] == 4
    assert [x["n_pool"] for x in js["clusters"]] == [50, 20, 8, 2]
    assert sum(x["n_selected"] for x in js["clusters"]) == 25
    assert all(x["n_selected"] >= 1 for x in js["clusters"])
    # within: centroid reads the centroid_sim column
    run_select(c, s, "cluster", 0.31, {"within": "centroid"}, out_p, out_j, seed=0)
    assert len(pd.read_parquet(out_p)) == 25


def test_run_select_random_and_mismatch(tmp_path):
    ids, clusters, scores = pool()
    c, s = _files(tmp_path, ids, clusters, scores, sim=False)
    out_p, out_j = tmp_path / "selection.parquet", tmp_path / "selection.json"
    js = run_select(c, s, "random", 0.5, None, out_p, out_j, seed=3)
    assert js["n_selected"] == 40 and js["quota"] is None
    assert sum(x["n_selected"] for x in js["clusters"]) == 40
    from clusterft.pipeline.io import write_parquet

    write_parquet(s, pd.DataFrame({"id": ids[::-1], "score": scores}))
    with pytest.raises(InputError, match="ids differ"):
        run_select(c, s, "random", 0.5, None, tmp_path / "x.parquet", tmp_path / "x.json", seed=0)
    assert not (tmp_path / "x.parquet").exists()
    with pytest.raises(InputError, match="does not exist"):
        run_select(tmp_path / "nope.parquet", s, "random", 0.5, None, out_p, out_j)


# ----------------------------------------------------------------------- baselines (issue 13)

@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, frac=st.floats(0.0, 1.0))
def test_s2l_quotas_smallest_first_and_exact(sizes, frac):
    from clusterft.stages.select import s2l_quotas

    total = int(round(frac * sum(sizes)))
    q = s2l_quotas(sizes, total)
    assert q.sum() == total and np.all(q <= np.asarray(sizes)) and np.all(q >= 0)
    # S2L's loop by hand: clusters by increasing size, each min(size, left // clusters left)
    left, want = total, {}
    order = sorted(range(len(sizes)), key=lambda c: (sizes[c], c))
    for i, c in enumerate(order):
        want[c] = min(sizes[c], left // (len(sizes) - i))
        left -= want[c]
    assert q.tolist() == [want[c] for c in range(len(sizes))]


def test_s2l_selection_balances_like_uniform_with_random_picks():
    from clusterft.stages.select import s2l_quotas

    ids, clusters, scores = pool()
    idx = select(ids, clusters, scores, "s2l", 0.31, seed=1)
    counts = np.bincount(clusters[idx], minlength=4)
    assert counts.tolist() == s2l_quotas(np.bincount(clusters), 25)[:4].tolist()
    assert counts.tolist() == [8, 8, 7, 2]  # 25 over sizes (50, 20, 8, 2): 2, then 23//3=7, 8, 8
    # within a cluster S2L samples at random (not by score)
    assert not np.array_equal(idx, select(ids, clusters, scores, "cluster", 0.31,
                                          {"within": "score"}, seed=1))


def _labels_file(tmp_path, ids, labels):
    from clusterft.pipeline.io import write_parquet

    p = tmp_path / "labels.parquet"
    write_parquet(p, pd.DataFrame({"id": ids, "label": labels}))
    return p


def test_oracle_per_label_counts_equal_the_quotas(tmp_path):
    ids, clusters, scores = pool()
    names = np.array(["repeat", "reverse", "sort", "dedupe"])
    truth = names[(clusters + 1) % 4]  # true labels are not the clusters
    c, s = _files(tmp_path, ids, clusters, scores)
    lab = _labels_file(tmp_path, ids, truth)
    out_p, out_j = tmp_path / "o.parquet", tmp_path / "o.json"
    for quota in ("uniform", "proportional", "sqrt"):
        js = run_select(c, s, "oracle", 0.31, {"quota": quota}, out_p, out_j, seed=0, labels=lab)
        df = pd.read_parquet(out_p)
        of = dict(zip(ids, truth))
        got = pd.Series([of[i] for i in df["id"]]).value_counts()
        pool_sizes = pd.Series(truth).value_counts().sort_index()  # codes follow sorted labels
        want = cluster_quotas(pool_sizes.to_numpy(), 25, quota)
        assert [int(got.get(lbl, 0)) for lbl in pool_sizes.index] == want.tolist()
        assert js["quota"] == quota and js["n_clusters"] == 4
    with pytest.raises(InputError, match="needs the labels"):
        run_select(c, s, "oracle", 0.31, None, out_p, out_j)
    short = _labels_file(tmp_path, ids[:-3], truth[:-3])
    with pytest.raises(InputError, match="3 pool ids have no label"):
        run_select(c, s, "oracle", 0.31, None, out_p, out_j, labels=short)


def test_rs2_writes_a_fresh_subset_per_epoch(tmp_path):
    ids, clusters, scores = pool()
    c, s = _files(tmp_path, ids, clusters, scores, sim=False)
    out_p, out_j = tmp_path / "o.parquet", tmp_path / "o.json"
    js = run_select(c, s, "rs2", 0.31, None, out_p, out_j, seed=2, epochs=3)
    df = pd.read_parquet(out_p)
    assert list(df.columns) == ["id", "cluster", "score", "epoch"]
    sizes = df.groupby("epoch").size()
    assert sizes.index.tolist() == [0, 1, 2] and set(sizes) == {25}
    assert not df.duplicated(["epoch", "id"]).any()
    subsets = [set(g["id"]) for _, g in df.groupby("epoch")]
    assert subsets[0] != subsets[1] != subsets[2]
    assert js["epochs"] == 3 and js["n_distinct"] == len(set().union(*subsets)) > 25
    assert js["n_selected"] == 25
    np.testing.assert_array_equal(np.sort([list(ids).index(i) for i in subsets[0]]),
                                  select(ids, clusters, scores, "rs2", 0.31, seed=2))
    run_select(c, s, "rs2", 0.31, None, tmp_path / "p.parquet", tmp_path / "p.json", seed=2,
               epochs=3)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "p.parquet"), df)  # by seed


def test_less_and_rds_read_the_validation_features(tmp_path):
    from clusterft.pipeline.io import save_npy, write_parquet
    from clusterft.tasks.targets import less_scores, rds_round_robin, top_k

    ids, clusters, scores = pool()
    rng = np.random.default_rng(4)
    f = rng.standard_normal((len(ids), 6))
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    t = rng.standard_normal((6, 6))
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    task = np.array(["a", "a", "b", "b", "c", "c"])
    c, s = _files(tmp_path, ids, clusters, scores)
    save_npy(tmp_path / "f.npy", f.astype(np.float32))
    save_npy(tmp_path / "t.npy", t.astype(np.float32))
    write_parquet(tmp_path / "t.parquet", pd.DataFrame({"id": [f"v{i}" for i in range(6)],
                                                        "task": task}))
    out_p, out_j = tmp_path / "o.parquet", tmp_path / "o.json"
    kw = dict(features=tmp_path / "f.npy", targets=tmp_path / "t.npy",
              target_ids=tmp_path / "t.parquet")
    f32, t32 = f.astype(np.float32), t.astype(np.float32)
    for method, want in (("less", top_k(less_scores(f32, t32, task), 25)),
                         ("rds", rds_round_robin(f32, t32, task, 25))):
        js = run_select(c, s, method, 0.31, None, out_p, out_j, seed=0, **kw)
        got = np.sort([list(ids).index(i) for i in pd.read_parquet(out_p)["id"]])
        np.testing.assert_array_equal(got, want)
        assert js["n_selected"] == 25 and js["quota"] is None
    with pytest.raises(InputError, match="needs features, targets"):
        run_select(c, s, "less", 0.31, None, out_p, out_j)
    save_npy(tmp_path / "t.npy", np.zeros((0, 6), dtype=np.float32))
    write_parquet(tmp_path / "t.parquet", pd.DataFrame({"id": [], "task": []}))
    with pytest.raises(InputError, match="val_per_task"):
        run_select(c, s, "rds", 0.31, None, out_p, out_j, **kw)
