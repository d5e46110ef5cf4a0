"""Property tests of ``clusterft.sampler.ClusterBalancedSampler`` (hypothesis) + explicit cases.

Every property of the issue is checked on random pools (cluster counts and sizes, ranks,
batch sizes, log-normal lengths, padding and dropping):
coverage/padding like DistributedSampler, stratified global batches, even deal per step and
per epoch, token-load balance (absolute and against random deals), determinism, validation.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from clusterft.sampler import ClusterBalancedSampler

FAST = settings(max_examples=60, deadline=None, derandomize=True)


# --------------------------------------------------------------------------- helpers
def make_pool(sizes: list[int], sigma: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Cluster ids (shuffled, cluster c has sizes[c] examples) and log-normal lengths."""
    rng = np.random.default_rng(seed)
    cid = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    lengths = np.maximum(1, np.round(rng.lognormal(5.0, sigma, len(cid)))).astype(np.int64)
    return cid, lengths


def zipf_sizes(n: int, clusters: int, a: float = 1.0) -> list[int]:
    w = 1.0 / np.arange(1, clusters + 1) ** a
    sizes = np.maximum(1, np.floor(n * w / w.sum())).astype(int)
    return sizes.tolist()


def samplers(cid, lengths, R, B, **kw) -> list[ClusterBalancedSampler]:
    return [ClusterBalancedSampler(cid, lengths, R, r, B, **kw) for r in range(R)]


def per_rank_plan(ss: list[ClusterBalancedSampler]) -> np.ndarray:
    """[steps, R, B] built only from what each rank's ``__iter__`` yields."""
    B, steps = ss[0].batch_size, ss[0].steps_per_epoch
    return np.stack([np.array(list(s), dtype=np.int64).reshape(steps, B) for s in ss], axis=1)


def counts(plan: np.ndarray, cid: np.ndarray, C: int) -> np.ndarray:
    """[steps, R, C]: examples of each cluster per step and rank."""
    S, R, B = plan.shape
    flat = (np.arange(S * R)[:, None] * C + cid[plan].reshape(S * R, B)).ravel()
    return np.bincount(flat, minlength=S * R * C).reshape(S, R, C)


def excess(plan: np.ndarray, lengths: np.ndarray) -> float:
    """Mean over steps of max/mean per-rank token load, minus 1."""
    load = lengths[plan].sum(axis=2).astype(float)
    return float((load.max(axis=1) / load.mean(axis=1)).mean() - 1.0)


def random_split_excess(plan: np.ndarray, lengths: np.ndarray, reps: int = 4) -> float:
    """Same global batches, randomly split over ranks (DistributedSampler-style)."""
    S, R, B = plan.shape
    rng = np.random.default_rng(0)
    out = [excess(rng.permuted(plan.reshape(S, R * B), axis=1).reshape(S, R, B), lengths)
           for _ in range(reps)]
    return float(np.mean(out))


def distributed_sampler_excess(N: int, lengths: np.ndarray, R: int, B: int,
                               reps: int = 4) -> float:
    """torch DistributedSampler (shuffle) + per-rank batches of B over the same pool."""
    ds = range(N)
    out = []
    for seed in range(reps):
        per_rank = [list(DistributedSampler(ds, num_replicas=R, rank=r, shuffle=True, seed=seed))
                    for r in range(R)]
        steps = len(per_rank[0]) // B
        plan = np.array([p[:steps * B] for p in per_rank]).reshape(R, steps, B)
        out.append(excess(plan.transpose(1, 0, 2), lengths))
    return float(np.mean(out))


@st.composite
def setups(draw, max_r: int = 6, max_b: int = 12, max_c: int = 12, max_size: int = 60):
    R = draw(st.integers(1, max_r))
    B = draw(st.integers(1, max_b))
    C = draw(st.integers(1, max_c))
    sizes = draw(st.lists(st.integers(1, max_size), min_size=C, max_size=C))
    drop = draw(st.booleans()) and sum(sizes) >= R * B
    return dict(R=R, B=B, sizes=sizes, drop=drop, seed=draw(st.integers(0, 2**31 - 1)),
                sigma=draw(st.floats(0.2, 1.2)), epoch=draw(st.integers(0, 5)))


def build(cfg):
    cid, lengths = make_pool(cfg["sizes"], cfg["sigma"], cfg["seed"])
    ss = samplers(cid, lengths, cfg["R"], cfg["B"], seed=cfg["seed"], drop_last=cfg["drop"])
    for s in ss:
        s.set_epoch(cfg["epoch"])
    return cid, lengths, ss


def slots_per_cluster(n_c: np.ndarray, T: int) -> np.ndarray:
    """What the sampler promises: n_c padded/dropped in proportion (floor or ceil)."""
    return n_c * T / n_c.sum()


# --------------------------------------------------------------------------- coverage
@FAST
@given(setups())
def test_coverage_padding_and_equal_lengths(cfg):
    cid, lengths, ss = build(cfg)
    R, B, N = cfg["R"], cfg["B"], len(cid)
    G = R * B
    steps = N // G if cfg["drop"] else -(-N // G)
    assert all(len(s) == steps * B and s.steps_per_epoch == steps for s in ss)
    plan = per_rank_plan(ss)                       # from __iter__ of every rank
    assert np.array_equal(plan, ss[0].global_plan(cfg["epoch"]))
    seen = np.bincount(plan.ravel(), minlength=N)
    T = steps * G
    if cfg["drop"]:
        assert seen.max() <= 1 and seen.sum() == T      # each kept index exactly once
    else:
        assert seen.min() >= 1 and seen.sum() == T      # every index, tail padded
        if T == N:
            assert seen.max() == 1
    C = len(cfg["sizes"])
    n_c = np.bincount(cid, minlength=C)
    m_c = np.bincount(cid[plan.ravel()], minlength=C)
    assert np.all(np.abs(m_c - slots_per_cluster(n_c, T)) < 1)   # pad/drop in proportion
    for c in range(C):                                  # repeats spread within the cluster
        k = seen[cid == c]
        if not cfg["drop"]:
            assert k.max() - k.min() <= 1


# --------------------------------------------------------------------------- stratification
@FAST
@given(setups())
def test_every_global_batch_is_stratified(cfg):
    cid, lengths, ss = build(cfg)
    plan = ss[0].global_plan(cfg["epoch"])
    S, R, B = plan.shape
    C = len(cfg["sizes"])
    K = counts(plan, cid, C).sum(axis=1)               # [steps, C] per global batch
    n_c = np.bincount(cid, minlength=C)
    m_c = K.sum(axis=0)
    assert np.all(K >= np.floor(m_c / S)) and np.all(K <= np.ceil(m_c / S))
    expected = R * B * n_c / len(cid)                  # share of the pool
    assert np.all(np.abs(K - expected) <= np.maximum(2, 0.1 * expected))
    assert np.all(np.abs(K - expected) < 1 + 1 / S)


def test_windows_of_steps_stay_proportional():
    """No stretch of training sees only a few clusters: 10-step windows are proportional."""
    cid, lengths = make_pool(zipf_sizes(5000, 20), 0.8, 1)
    s = ClusterBalancedSampler(cid, lengths, 4, 0, 16, seed=3)
    K = counts(s.global_plan(0), cid, 20).sum(axis=1)
    share = np.bincount(cid, minlength=20) / len(cid)
    for w in (1, 10, 30):
        win = np.lib.stride_tricks.sliding_window_view(K, w, axis=0).sum(axis=2)
        exp = w * 64 * share
        assert np.all(np.abs(win - exp) <= np.maximum(2, 0.1 * exp)), w
    # a random order (what a shuffled DistributedSampler gives) is visibly worse
    rng = np.random.default_rng(0)
    full = (len(cid) // 64) * 64
    Kr = counts(rng.permutation(len(cid))[:full].reshape(-1, 4, 16), cid, 20).sum(axis=1)
    assert np.abs(Kr - 64 * share).max() > np.abs(K - 64 * share).max() + 1


# --------------------------------------------------------------------------- even deal
@FAST
@given(setups())
def test_clusters_dealt_evenly_per_step_and_epoch(cfg):
    cid, lengths, ss = build(cfg)
    plan = per_rank_plan(ss)
    S, R, B = plan.shape
    n = counts(plan, cid, len(cfg["sizes"]))           # [S, R, C]
    assert np.all(n.max(axis=1) - n.min(axis=1) <= 1)  # every step, every cluster
    epoch = n.sum(axis=0)                               # [R, C]
    fair = epoch.sum(axis=0) / R                        # global count / num_replicas
    # the bound, read as max(2% of it, 1 example) ...
    assert np.all(np.abs(epoch - fair) <= np.maximum(0.02 * fair, 1))
    # ... and what the sampler actually promises: floor or ceil of it
    assert np.all(np.abs(epoch - fair) < 1)


# --------------------------------------------------------------------------- token loads
@settings(max_examples=20, deadline=None, derandomize=True)
@given(R=st.integers(2, 8), B=st.integers(16, 32), C=st.integers(1, 30),
       zipf=st.floats(0.0, 1.5), sigma=st.floats(0.3, 0.8), steps=st.integers(10, 40),
       seed=st.integers(0, 2**31 - 1))
def test_token_loads_balanced_large_batches(R, B, C, zipf, sigma, steps, seed):
    N = steps * R * B - seed % (R * B)
    cid, lengths = make_pool(zipf_sizes(N, C, zipf), sigma, seed)
    s = ClusterBalancedSampler(cid, lengths, R, 0, B, seed=seed)
    plan = s.global_plan(0)
    ex = excess(plan, lengths)
    assert ex <= 0.05                                   # mean over steps of max/mean <= 1.05
    assert ex <= 0.5 * random_split_excess(plan, lengths)
    assert ex <= 0.5 * distributed_sampler_excess(len(cid), lengths, R, B)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(R=st.integers(2, 8), B=st.integers(1, 24), C=st.integers(1, 20),
       per_cluster=st.integers(4, 40), sigma=st.floats(0.4, 1.0), seed=st.integers(0, 2**31 - 1))
def test_token_loads_beat_random_deal_at_any_batch_size(R, B, C, per_cluster, sigma, seed):
    """Excess over 1 <= half that of a DistributedSampler deal of the same pool.

    At batch_size < 8 this relies on length grouping (default there): with one or two
    examples per rank no deal of a given global batch can halve the random excess.
    """
    N = max(C * per_cluster, 50 * R * B)         # >= 50 steps: means over steps settle
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(N - C * 4, np.ones(C) / C) + 4  # every cluster has >= 4
    cid, lengths = make_pool(sizes.tolist(), sigma, seed)
    s = ClusterBalancedSampler(cid, lengths, R, 0, B, seed=seed)
    plan = s.global_plan(1)
    ex = excess(plan, lengths)
    assert ex <= 0.5 * distributed_sampler_excess(N, lengths, R, B)
    if B >= 8:  # no grouping: the deal alone halves a random split of the same batches
        assert not s.length_grouping
        assert ex <= 0.5 * random_split_excess(plan, lengths)


def test_many_small_clusters_still_balanced():
    """40 Zipf clusters (most with < 1 example per step): the swaps across clusters keep
    loads within 1% (the greedy deal alone leaves about 3%)."""
    cid, lengths = make_pool(zipf_sizes(3000, 40), 0.8, 4)
    plan = ClusterBalancedSampler(cid, lengths, 4, 0, 16, seed=0).global_plan(0)
    assert excess(plan, lengths) <= 0.01


def test_length_grouping_is_what_balances_tiny_batches():
    cid, lengths = make_pool(zipf_sizes(3000, 10), 0.8, 2)
    on = ClusterBalancedSampler(cid, lengths, 4, 0, 2, seed=0)
    off = ClusterBalancedSampler(cid, lengths, 4, 0, 2, seed=0, length_grouping=False)
    assert on.length_grouping and not off.length_grouping
    ref = distributed_sampler_excess(len(cid), lengths, 4, 2)
    ex_on, ex_off = excess(on.global_plan(0), lengths), excess(off.global_plan(0), lengths)
    assert ex_on < 0.5 * ref < ex_off
    # grouped batches still change from epoch to epoch
    p0, p1 = on.global_plan(0), on.global_plan(1)
    same = {frozenset(r) for r in p0.reshape(len(p0), -1).tolist()}
    assert sum(frozenset(r) in same for r in p1.reshape(len(p1), -1).tolist()) < 0.05 * len(p1)


def test_token_balance_bounded_by_single_long_examples():
    """Heavy tails (sigma=1.2): within 0.02 of a lower bound that no deal can beat."""
    cid, lengths = make_pool(zipf_sizes(8000, 20), 1.2, 4)
    plan = ClusterBalancedSampler(cid, lengths, 8, 0, 16, seed=0).global_plan(0)
    L = lengths[plan].reshape(len(plan), -1).astype(float)
    srt = np.sort(L, axis=1)
    mean = L.sum(axis=1) / 8
    bound = np.maximum(mean, srt[:, -1] + srt[:, :15].sum(axis=1))  # heaviest example's rank
    assert excess(plan, lengths) <= float((bound / mean).mean() - 1) + 0.02


# --------------------------------------------------------------------------- determinism
@settings(max_examples=20, deadline=None, derandomize=True)
@given(setups())
def test_deterministic_in_seed_and_epoch(cfg):
    cid, lengths, ss = build(cfg)
    e = cfg["epoch"]
    again = ClusterBalancedSampler(cid.tolist(), lengths.tolist(), cfg["R"], 0, cfg["B"],
                                   seed=cfg["seed"], drop_last=cfg["drop"])
    assert np.array_equal(again.global_plan(e), ss[-1].global_plan(e))
    if len(cid) >= 16:  # enough examples that two random plans coinciding is negligible
        assert not np.array_equal(ss[0].global_plan(e), ss[0].global_plan(e + 1))
        other = ClusterBalancedSampler(cid, lengths, cfg["R"], 0, cfg["B"],
                                       seed=cfg["seed"] + 1, drop_last=cfg["drop"])
        assert not np.array_equal(other.global_plan(e), ss[0].global_plan(e))


def test_set_epoch_changes_iteration_and_cache():
    cid, lengths = make_pool([30, 20, 10], 0.5, 0)
    s = ClusterBalancedSampler(cid, lengths, 2, 1, 4, seed=7)
    a = list(s)
    s.set_epoch(1)
    b = list(s)
    s.set_epoch(0)
    assert list(s) == a and a != b
    assert s.global_plan(3) is s.global_plan(3)           # cached
    assert not s.global_plan(3).flags.writeable


# --------------------------------------------------------------------------- usage
def test_works_with_dataloader_batches_in_step_order():
    cid, lengths = make_pool([50, 30, 15, 5], 0.7, 3)
    ds = TensorDataset(torch.arange(len(cid)))
    R, B = 3, 5
    for r in range(R):
        s = ClusterBalancedSampler(cid, lengths, R, r, B, seed=1)
        s.set_epoch(2)
        loader = DataLoader(ds, batch_size=B, sampler=s, shuffle=False)
        got = np.stack([x.numpy() for (x,) in loader])
        assert len(loader) == s.steps_per_epoch == got.shape[0]
        assert np.array_equal(got, s.global_plan(2)[:, r, :])


def test_explicit_small_case():
    """3 clusters (6, 3, 3) on 2 ranks x 3: each step has 3 of cluster 0, split 1/2."""
    cid = np.array(["a"] * 6 + ["b"] * 3 + ["c"] * 3)
    lengths = np.arange(1, 13)
    s = ClusterBalancedSampler(cid, lengths, 2, 0, 3, seed=0, length_grouping=False)
    plan = s.global_plan(0)
    assert plan.shape == (2, 2, 3) and sorted(plan.ravel().tolist()) == list(range(12))
    n = counts(plan, np.unique(cid, return_inverse=True)[1], 3)
    assert n[:, :, 0].sum(axis=1).tolist() == [3, 3]
    assert np.all(np.sort(n[:, :, 0], axis=1) == [1, 2])
    assert sorted(n[:, :, 1:].sum(axis=(1, 2)).tolist()) == [3, 3]


def test_pool_smaller_than_one_global_batch_pads_repeatedly():
    cid, lengths = np.array([0, 0, 1, 2, 2]), np.array([5, 9, 3, 7, 7])
    ss = samplers(cid, lengths, 4, 4)
    plan = per_rank_plan(ss)
    assert plan.shape == (1, 4, 4)
    seen = np.bincount(plan.ravel(), minlength=5)
    assert seen.min() >= 3 and seen.sum() == 16
    n = counts(plan, cid, 3)
    assert np.all(n.max(axis=1) - n.min(axis=1) <= 1)


def test_single_rank_and_single_cluster():
    cid, lengths = make_pool([37], 0.5, 0)
    s = ClusterBalancedSampler(cid, lengths, 1, 0, 5, drop_last=True)
    assert len(s) == 35 and len(set(s)) == 35


def test_fast_enough():
    """50k examples, 20 Zipf clusters, 4 ranks x 16: one epoch's plan in well under 3 s."""
    cid, lengths = make_pool(zipf_sizes(50_000, 20), 0.8, 0)
    s = ClusterBalancedSampler(cid, lengths, 4, 0, 16, seed=0)
    t = time.perf_counter()
    s.global_plan(0)
    assert time.perf_counter() - t < 3.0


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=2), "rank"),
    (dict(rank=-1), "rank"),
    (dict(num_replicas=0, rank=0), "num_replicas"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=-3), "batch_size"),
    (dict(lengths=[1, 2, 3]), "lengths"),
    (dict(cluster_ids=[], lengths=[]), "empty"),
    (dict(lengths=[1, 2, float("nan"), 4]), "finite"),
    (dict(lengths=[1, 2, -1, 4]), ">= 0"),
    (dict(lengths=["a", "b", "c", "d"]), "numbers"),
    (dict(batch_size=3, drop_last=True), "drop_last"),
    (dict(batch_size=2.0), "int"),
    (dict(rank=True), "int"),
    (dict(cluster_ids=[[0, 1], [1, 0]]), "1-D"),
])
def test_bad_arguments_raise_clear_value_errors(kwargs, match):
    args = dict(cluster_ids=[0, 1, 1, 0], lengths=[3, 4, 5, 6], num_replicas=2, rank=0,
                batch_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ClusterBalancedSampler(**args)
