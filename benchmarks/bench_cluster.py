"""Benchmark cosine k-means: the numpy reference vs faiss (``cluster.backend``), side by side.

Both backends cluster the same seeded data in one process: a Gaussian mixture on the
sphere (``--k`` random unit directions, each row = its direction + ``--noise`` x N(0, I/d),
L2-normalised, float32), N rows x d dims for every N in ``--sizes`` and d in ``--dims``.
Each cell times ``clusterft.stages.cluster.cosine_kmeans(x, k, seed, n_init, max_iter, backend)``
end to end (normalisation, seeding, iterations, final assignment, numbering); the figure
is the median of ``--repeats`` runs. Both run on one core: faiss sets one thread inside
the call, and numpy's BLAS is pinned to one thread here before numpy is imported, so the
ratio is per core. Time grows about linearly with ``--n-init`` (restarts), so the default
is 1 restart; the stage's own default is ``cluster.n_init`` = 10.

numpy is skipped above ``--numpy-max-elements`` (N x d; at 10^6 x 256 and beyond one
reference run takes minutes and 2+ GB of float64 copies); the table says so.

Prints a table (seconds, the two backends' label agreement as ARI and the relative gap of
their total cosine objective), then, last, the numpy/faiss time ratios and the growth
exponent of time vs N per backend and d (the slope of log time vs log N).

    python benchmarks/bench_cluster.py [--sizes 10000 100000 1000000] [--dims 256 1024]
        [--k 64] [--n-init 1] [--max-iter 25] [--repeats 3] [--smoke]

``--smoke`` (tiny sizes, seconds) checks that the script runs; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time

# One BLAS thread for numpy (faiss sets its own inside cosine_kmeans): set before numpy loads.
for _k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_k] = "1"

import numpy as np  # noqa: E402

from clusterft.stages.cluster import cosine_kmeans  # noqa: E402
from clusterft.analysis.stats import cluster_agreement  # noqa: E402

BACKENDS = ("numpy", "faiss")


def sphere_mixture(n: int, d: int, k: int, noise: float, seed: int,
                   chunk: int = 65536) -> np.ndarray:
    """[n, d] float32 unit rows around k random unit directions (seeded; built in blocks)."""
    rng = np.random.default_rng([seed, n, d, k])
    centres = rng.standard_normal((k, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        block = centres[rng.integers(k, size=m)]
        block += rng.standard_normal((m, d), dtype=np.float32) * np.float32(noise / np.sqrt(d))
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        x[start:start + m] = block
    return x


def objective(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> float:
    """Total cosine of the (unit) rows with their centroids, in float64 row blocks."""
    c = centroids.astype(np.float64)
    return float(sum((x[i:i + 65536].astype(np.float64) * c[labels[i:i + 65536]]).sum()
                     for i in range(0, len(x), 65536)))


def time_backend(x, args, backend):
    """Median seconds of ``args.repeats`` runs, and the last run's (labels, centroids)."""
    times, out = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = cosine_kmeans(x, args.k, seed=args.seed, n_init=args.n_init,
                            max_iter=args.max_iter, backend=backend)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def growth_exponent(ns: list[int], secs: list[float]) -> float:
    """Slope of log(time) vs log(N): 1 = linear in N."""
    return float(np.polyfit(np.log(ns), np.log(secs), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                    help="pool sizes N")
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024], help="feature dims d")
    ap.add_argument("--k", type=int, default=64, help="clusters (and mixture components)")
    ap.add_argument("--n-init", type=int, default=1, help="restarts (the stage's default: 10)")
    ap.add_argument("--max-iter", type=int, default=25,
                    help="rounds per restart; both stop earlier when converged")
    ap.add_argument("--noise", type=float, default=1.0,
                    help="per-row noise scale around its direction (cos ~ 1/sqrt(1+noise^2))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--numpy-max-elements", type=float, default=1.1e8,
                    help="skip numpy where N*d exceeds this (its runs take minutes there)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (N 500 2000, d 16 32, k 8, 1 repeat) in seconds; "
                    "checks the script, its times mean nothing")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.dims, args.k, args.repeats = [500, 2000], [16, 32], 8, 1
    import faiss  # noqa: F401  (imported here, not inside the first timed call)

    try:
        from threadpoolctl import threadpool_info

        blas = ", ".join(f"{i['internal_api']} {i['num_threads']} thr" for i in threadpool_info())
    except ImportError:
        blas = "unknown"
    print(f"cosine_kmeans: k={args.k}, n_init={args.n_init}, max_iter={args.max_iter}, "
          f"noise={args.noise}, seed={args.seed}; median of {args.repeats} runs; faiss "
          f"{faiss.__version__} (1 thread), numpy {np.__version__} (BLAS: {blas})")
    warm = sphere_mixture(256, 8, 4, args.noise, args.seed)
    for backend in BACKENDS:  # first-call costs (OpenMP/BLAS start-up) out of every timing
        cosine_kmeans(warm, 4, seed=0, n_init=1, max_iter=2, backend=backend)
    t_start = time.perf_counter()
    secs: dict[tuple[str, int, int], float] = {}
    print(f"{'d':>6}{'N':>10}{'numpy s':>11}{'faiss s':>11}{'ARI':>7}{'obj gap':>10}")
    for d in args.dims:
        for n in args.sizes:
            x = sphere_mixture(n, d, args.k, args.noise, args.seed)
            res = {}
            for backend in BACKENDS:
                if backend == "numpy" and n * d > args.numpy_max_elements:
                    continue
                secs[backend, d, n], res[backend] = time_backend(x, args, backend)
            cells = [f"{secs[b, d, n]:>11.3f}" if (b, d, n) in secs else f"{'skipped':>11}"
                     for b in BACKENDS]
            if len(res) == 2:
                ari = cluster_agreement(res["faiss"][0], res["numpy"][0])["ari"]
                o_n, o_f = objective(x, *res["numpy"]), objective(x, *res["faiss"])
                extra = f"{ari:>7.3f}{(o_f - o_n) / abs(o_n):>+10.1e}"
            else:
                extra = f"{'-':>7}{'-':>10}"
            print(f"{d:>6}{n:>10}{''.join(cells)}{extra}", flush=True)
            del x
    skipped = [(d, n) for d in args.dims for n in args.sizes if ("numpy", d, n) not in secs]
    if skipped:
        print(f"numpy skipped where N*d > {args.numpy_max_elements:.3g} (minutes per run): "
              + ", ".join(f"N={n} d={d}" for d, n in skipped))
    print("(ARI: agreement of the two labelings; obj gap: (faiss - numpy) / numpy total cosine)")
    print(f"\ntotal {time.perf_counter() - t_start:.1f}s")
    print("\nnumpy/faiss time ratio:")
    for d in args.dims:
        ratios = [f"N={n}: {secs['numpy', d, n] / secs['faiss', d, n]:.2f}x"
                  for n in args.sizes if ("numpy", d, n) in secs]
        print(f"  d={d}: " + (", ".join(ratios) if ratios else "no numpy run"))
    print("growth exponent of time vs N (log-log slope; 1 = linear):")
    for d in args.dims:
        parts = []
        for b in BACKENDS:
            ns = [n for n in args.sizes if (b, d, n) in secs]
            if len(ns) >= 2:
                parts.append(f"{b} {growth_exponent(ns, [secs[b, d, n] for n in ns]):.2f} "
                             f"(N {min(ns)}..{max(ns)})")
            else:
                parts.append(f"{b} n/a (fewer than 2 sizes)")
        print(f"  d={d}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
