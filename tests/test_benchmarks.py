"""Each benchmark with a smoke mode runs from its one command and prints its ratios last
(CI keeps them working; their figures at smoke sizes mean nothing and are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,last", [("bench_cluster.py", "growth exponent"),
                                         ("bench_projection.py", "ratios"),
                                         ("bench_sampler.py", "ratios"),
                                         ("bench_gpu_token_cost.py", "ratios"),
                                         ("bench_threads.py", "ratios")])
def test_benchmark_smoke_runs_and_prints_ratios_last(script: str, last: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    tail = out.stdout.strip().splitlines()[-8:]
    assert any(last in line for line in tail), out.stdout[-2000:]
    assert any("x" in line and any(c.isdigit() for c in line) for line in tail)


def _smoke(script: str) -> list[str]:
    """stdout lines of ``benchmarks/<script> --smoke`` (which must succeed)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def _ratios(line: str) -> list[float]:
    import re

    return [float(v) for v in re.findall(r"(\d+\.\d+)x", line)]


def test_bench_score_smoke_methods_agree_with_the_loop_and_ratios_last() -> None:
    lines = _smoke("bench_score.py")
    assert lines[-1].startswith("ratios") and len(_ratios(lines[-1])) == 4
    table = [ln for ln in lines if ln.startswith(("loop", "hook", "func"))]
    assert len(table) == 5
    assert all(float(ln.split()[-1]) > 0.99999 for ln in table)  # min cosine to the loop


def test_bench_train_step_smoke_rewrites_are_exact_and_ratios_last() -> None:
    lines = _smoke("bench_train_step.py")
    assert lines[-1].startswith("ratios") and len(_ratios(lines[-1])) >= 3
    exact = [ln for ln in lines if ln.startswith(("micro-batches", "label-only head"))]
    assert len(exact) == 3  # fp32 rewrites: float noise only
    assert all(float(ln.split()[-1]) < 1e-5 for ln in exact)


def test_bench_score_vs_train_smoke_prints_both_projections_last() -> None:
    lines = _smoke("bench_score_vs_train.py")
    assert lines[-4].startswith("ratios, score / train step")
    for line, key in zip(lines[-3:], ("dense", "kronecker", "dense-full")):
        assert line.split()[0] == key and len(_ratios(line)) == 6  # wall, then CPU
        grads, method, stage, grads_cpu, method_cpu, stage_cpu = _ratios(line)
        # the warm-up's steps cost, and its loss passes on top
        assert 0 < grads < method < stage and 0 < grads_cpu < method_cpu < stage_cpu
    assert any("(48 examples trained)" in ln for ln in lines)


def test_bench_job_overhead_smoke_skips_part_two_honestly() -> None:
    lines = _smoke("bench_job_overhead.py")
    assert any("skipped" in ln for ln in lines)
    assert lines[-1].startswith("ratios") and len(_ratios(lines[-1])) == 1


def test_gpu_token_cost_skips_clearly_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script measures instead of skipping")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_token_cost.py")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("skipped: no CUDA GPU")


# --------------------------------------------------------------- the balancing anchors
sys.path.insert(0, str(ROOT / "benchmarks"))
from balancing_anchors import (first_fit_decreasing, karmarkar_karp, kk_plan,  # noqa: E402
                               multipack_plan)


def test_first_fit_decreasing_packs_as_by_hand() -> None:
    # sorted 5 4 3 3 2 2 1 into 10s: [5 4 1] and [3 3 2 2] (positions into the list)
    assert first_fit_decreasing([3, 5, 2, 4, 1, 3, 2], 10) == [[1, 3, 4], [0, 5, 2, 6]]
    assert first_fit_decreasing([3, 5, 2, 4, 1, 3, 2], 10, max_bins=1) is None
    assert first_fit_decreasing([11], 10) is None


def test_karmarkar_karp_is_the_largest_differencing_method() -> None:
    # the textbook case where KK misses the perfect split {8,7} / {6,5,4}: difference 2
    # (greedy longest-first gets 4), so this is KK, not a greedy deal
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    # equal size (verl's data-parallel setting): [1 2 | 3 4] -> {1,4} {2,3}
    parts = karmarkar_karp([1, 2, 3, 4], 2, equal_size=True)
    assert sorted(map(sorted, parts)) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="divide"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def test_karmarkar_karp_equal_size_near_optimal_on_small_random_cases() -> None:
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.integers(1, 100, 8)
        parts = karmarkar_karp(x.tolist(), 2, equal_size=True)
        assert [len(p) for p in parts] == [4, 4]
        kk = max(sum(x[p]) for p in parts)
        best = min(max(x[list(c)].sum(), x.sum() - x[list(c)].sum())
                   for c in itertools.combinations(range(8), 4))
        assert best <= kk <= best + x.max() // 2  # within half an item of the optimum


def test_anchor_plans_cover_every_index_and_respect_budgets() -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 203)
    order = rng.permutation(203)
    steps = multipack_plan(lengths, order, ranks=4, capacity=600)
    flat = sorted(i for s in steps for b in s for i in b)
    assert flat == list(range(203))
    assert all(len(s) == 4 and all(lengths[b].sum() <= 600 for b in s) for s in steps)
    with pytest.raises(ValueError, match="longest"):
        multipack_plan(lengths, order, ranks=4, capacity=100)
    plan = kk_plan(lengths, order, ranks=4, batch=8)
    assert plan.shape == (6, 4, 8)  # 203 // 32 full global batches
    assert sorted(plan.ravel().tolist()) == sorted(order[:192].tolist())


def test_skill_recovery_real_smoke_prints_the_table_last(tmp_path) -> None:
    """SmolLM2-135M end to end on a few examples per pool (model conversion included): every
    pool x k x feature kind gets an ARI and an NMI, in the CSV and in the table printed last."""
    import csv

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "skill_recovery_real.py"),
                          "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    table = [ln for ln in lines[-8:] if ln.startswith("| ") and "---" not in ln]
    assert table[0].split("|")[1].strip() == "pool" and len(table) == 1 + 3 * 2
    assert {ln.split("|")[1].strip() for ln in table[1:]} == {"skills", "icd10", "pycode"}
    assert "ARI gradient" in table[0] and "NMI loss" in table[0]
    rows = list(csv.DictReader((tmp_path / "skill_recovery_real.csv").open()))
    assert len(rows) == 3 * 2 * 4  # pools x (config k, label k) x feature kinds
    assert {r["features"] for r in rows} == {"gradient", "embedding", "tfidf", "loss"}
    assert all(-1 <= float(r["ari"]) <= 1 and 0 <= float(r["nmi"]) <= 1 for r in rows)
    assert (tmp_path / "skill_recovery_real.md").read_text().strip() == "\n".join(lines[-8:])


def test_gpu_rehearsal_cpu_quick_path(tmp_path) -> None:
    """The GPU rehearsal's CPU path at tiny sizes (bf16 autocast over float32 weights, as a
    CPU runs it): every step runs, every check that applies on a CPU passes, the GPU-only
    figures read n/a, and the table is printed last (no GPU figure is asserted here)."""
    import json

    out = tmp_path / "rehearsal.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_rehearsal.py"),
                           "--device", "cpu", "--quick", "--precision", "bf16", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["meta"]["device"] == "cpu" and r["model"]["kind"] == "tiny"
    assert set(r["checks"]) >= {"load: base dtype float32", "score: LoRA float32",
                                "score: projected rows float32", "score: cosine to fp32 >= 0.95",
                                "train: grouped: only NOT_KEPT.json",
                                "train: padded: adapter saved", "generate: generated"}
    assert all(r["checks"].values()), r["checks"]
    assert r["load"]["allocated_bytes"] is None  # a CPU has no allocator figures
    assert r["score"]["precision"] == "bf16" and r["train"]["padded"]["precision"] == "bf16"
    assert 0.95 <= r["score"]["cosine_to_fp32"]["min"] < 1.0  # autocast did run
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("| total") and any("cosine to fp32" in ln for ln in lines[-30:])


def test_rule_times_parts_on_the_paper_configs_paths() -> None:
    """benchmarks/rule_times.part_of on benchmark paths of config/paper.yaml's jobs (8-GPU
    accuracy runs, 4- and 8-GPU time runs with both distributions, sharded evaluation, no
    ablation): the time runs are the time sweep (not an ablation), the selections and the
    sharded base evaluation are classified, a baseline is a baseline."""
    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rule_times import part_of
    from clusterft.plan.config import settings
    from clusterft.plan.sweep import Sweep

    plan = Sweep(settings(yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())))
    cell = "codealpaca/llama7b"
    cases = {
        ("train", f"{cell}/cluster-0.31/g8-balanced/s0"): "paper protocol",
        ("train", f"{cell}/cluster-0.31/g8-random/s0"): "time sweep",
        ("train", f"{cell}/random-0.31/g4-balanced/s0"): "time sweep",
        ("train", f"{cell}/full-1/g4-random/s0"): "time sweep",
        ("evaluate_shard", f"{cell}/rs2-0.31/g8-balanced/s1/shards/0-of-2"): "baselines and skill recovery (other feature kinds)",
        ("select", f"{cell}/cluster-0.05/s2"): "paper protocol",
        ("select", f"{cell}/less-0.31/s0"): "baselines and skill recovery (other feature kinds)",
        ("evaluate_shard", f"{cell}/base/shards/1-of-2"): "base model's evaluation",
        ("evaluate", f"{cell}/base"): "base model's evaluation",
        ("score_shard", f"{cell}/s0/shard1"): "paper protocol",
        ("cluster", f"{cell}/gradient/s0"): "paper protocol",
        ("features", f"{cell}/embedding/s0"): "baselines and skill recovery (other feature kinds)",
    }
    for (rule, path), part in cases.items():
        assert part_of(rule, path, plan) == f"{cell}: {part}", (rule, path)
    assert part_of("base_model", "llama13b", plan) == "base model llama13b"
    assert part_of("corpus", "", plan).startswith("shared")


def test_bench_matmul_smoke_kernels_agree_and_ratios_last() -> None:
    from clusterft.modeling import cpu_matmul

    lines = _smoke("bench_matmul.py")
    if not cpu_matmul.onednn_available():
        assert "nothing to compare" in lines[-1]
        return
    assert lines[-1].startswith("ratios") and len(_ratios(lines[-1])) == 12
    gap = [ln for ln in lines if "training step's gradients" in ln]
    assert len(gap) == 1 and float(gap[0].split("=")[-1]) < 1e-4  # float rounding only
