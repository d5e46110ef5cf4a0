"""The field's two token-balancing anchors, re-implemented for side-by-side benchmarks.

Neither library is a dependency of the suite (axolotl and verl each pull a full training
stack), so ``benchmarks/bench_sampler.py`` compares ``ClusterBalancedSampler`` against
these small re-implementations of their algorithms; ``tests/test_benchmarks.py``
checks them on small cases with known answers.

* **Multipack** (axolotl's ``MultipackBatchSampler``): walk the shuffled data and, at
  every step, take the longest run of upcoming examples that first-fit-decreasing packs
  into one bin per rank of ``capacity`` tokens (a per-rank token budget); each rank trains
  on one bin, its sequences packed into one row (no padding between them). The number of
  examples per step varies; no bin holds more than ``capacity`` tokens.
* **Karmarkar-Karp** (verl's ``get_seqlen_balanced_partitions``, the largest differencing
  method): split one global batch's sequence lengths into ``k`` partitions of near-equal
  sums; with ``equal_size`` every partition gets ``len/k`` items (verl's setting for
  data-parallel ranks), by starting from sorted groups of ``k`` items.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np

__all__ = ["first_fit_decreasing", "karmarkar_karp", "kk_plan", "multipack_plan"]


def first_fit_decreasing(lengths: Sequence[float], capacity: float,
                         max_bins: int | None = None) -> list[list[int]] | None:
    """Pack item positions into bins of ``capacity`` by first-fit-decreasing.

    Items are taken longest first (ties by position) and each goes into the first bin with
    room, a new bin if none has. Returns the bins (lists of positions into ``lengths``), or
    None when an item exceeds ``capacity`` or more than ``max_bins`` bins would be needed.
    """
    ln = np.asarray(lengths, dtype=np.float64)
    order = np.argsort(-ln, kind="stable")
    room: list[float] = []
    bins: list[list[int]] = []
    for i in order.tolist():
        x = ln[i]
        if x > capacity:
            return None
        for b, r in enumerate(room):
            if r >= x:
                room[b] -= x
                bins[b].append(i)
                break
        else:
            if max_bins is not None and len(bins) >= max_bins:
                return None
            room.append(capacity - x)
            bins.append([i])
    return bins


def multipack_plan(lengths: np.ndarray, order: np.ndarray, ranks: int,
                   capacity: float) -> list[list[list[int]]]:
    """Axolotl-style multipack steps over ``order`` (a permutation of example indices).

    Each step is ``ranks`` bins (lists of example indices, some possibly empty at the end):
    the longest prefix of the remaining examples that first-fit-decreasing packs into
    ``ranks`` bins of ``capacity`` tokens, found by binary search as axolotl does. Every
    index of ``order`` appears exactly once. ``capacity`` must hold the longest example.
    """
    ln = np.asarray(lengths, dtype=np.float64)
    if len(order) and ln[order].max() > capacity:
        raise ValueError(f"capacity {capacity} is below the longest example "
                         f"({ln[order].max():g} tokens)")
    steps: list[list[list[int]]] = []
    pos, n = 0, len(order)
    while pos < n:
        # upper bound: no more items than fit by total tokens (or are left)
        cum = np.cumsum(ln[order[pos:]])
        hi = int(np.searchsorted(cum, ranks * capacity, side="right"))
        hi = max(1, min(hi, n - pos))
        lo, best = 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            got = first_fit_decreasing(ln[order[pos:pos + mid]], capacity, max_bins=ranks)
            if got is None:
                hi = mid - 1
            else:
                lo, best = mid + 1, (mid, got)
        mid, bins = best
        idx = order[pos:pos + mid]
        step = [idx[b].tolist() for b in bins] + [[] for _ in range(ranks - len(bins))]
        steps.append(step)
        pos += mid
    return steps


def karmarkar_karp(lengths: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing method: ``k`` partitions of positions with near-equal sums.

    As verl's ``karmarkar_karp``: every state holds ``k`` partial partitions sorted by sum;
    the two states of largest spread (max - min sum) are merged, the largest partition of
    one with the smallest of the other, until one state is left. ``equal_size`` starts from
    the sorted items in groups of ``k`` (one per partition), so every partition ends with
    ``len / k`` items (``len`` must divide by ``k``). Deterministic.
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the item count ({n}) to divide by k ({k})")
    items = sorted((float(x), i) for i, x in enumerate(lengths))
    tick = itertools.count()
    heap: list = []

    def push(parts: list[tuple[float, list[int]]]) -> None:
        parts.sort(key=lambda p: p[0], reverse=True)
        spread = parts[0][0] - parts[-1][0]
        heapq.heappush(heap, (-spread, -parts[0][0], next(tick), parts))

    if equal_size:
        for off in range(0, n, k):
            push([(x, [i]) for x, i in items[off:off + k]])
    else:
        for x, i in items:
            push([(x, [i])] + [(0.0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    return [sorted(p[1]) for p in heap[0][3]]


def kk_plan(lengths: np.ndarray, order: np.ndarray, ranks: int, batch: int) -> np.ndarray:
    """verl-style steps: ``order`` cut into global batches of ``ranks * batch`` examples
    (the incomplete tail dropped), each split over the ranks by equal-size Karmarkar-Karp.
    Returns ``[steps, ranks, batch]`` example indices."""
    G = ranks * batch
    steps = len(order) // G
    plan = np.empty((steps, ranks, batch), dtype=np.int64)
    ln = np.asarray(lengths)
    for s in range(steps):
        idx = order[s * G:(s + 1) * G]
        for r, part in enumerate(karmarkar_karp(ln[idx], ranks, equal_size=True)):
            plan[s, r] = idx[part]
    return plan
