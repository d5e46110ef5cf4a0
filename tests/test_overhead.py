"""clusterft.analysis.overhead on run folders laid out as the workflow writes them (Snakemake's
benchmark tsv files, train metrics, features, clusters, a safetensors model): exact ratios,
the paper-scale projection by its stated laws, and errors naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from clusterft.analysis import overhead
from clusterft.pipeline.errors import InputError

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _tsv(root: Path, rel: str, s: float) -> None:
    """A benchmark file as Snakemake writes it (header + one row)."""
    p = root / "benchmarks" / "out" / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(HEADER + f"{s:.2f}\t0:00:{int(s):02d}\t500.1\t1300.2\t350.0\t390.0\t0.1\t0.0"
                 f"\t20.0\t{s / 2:.2f}\n")


def make_run(root: Path, seeds=(0, 1), ds: str = "ds", model: str = "m") -> None:
    """Per seed s: score 10+s, cluster 2, select 1, train cluster-0.31 8, full 40 (1 GPU,
    balanced), plus files the table must ignore (other methods, kinds, rules)."""
    for s in seeds:
        _tsv(root, f"score/{ds}/{model}/s{s}.tsv", 10 + s)
        _tsv(root, f"cluster/{ds}/{model}/gradient/s{s}.tsv", 2)
        _tsv(root, f"cluster/{ds}/{model}/embedding/s{s}.tsv", 99)
        _tsv(root, f"select/{ds}/{model}/cluster-0.31/s{s}.tsv", 1)
        _tsv(root, f"select/{ds}/{model}/embed-cluster-0.31/s{s}.tsv", 99)
        _tsv(root, f"select/{ds}/{model}/full-1/s{s}.tsv", 99)
        _tsv(root, f"train/{ds}/{model}/cluster-0.31/g1-balanced/s{s}.tsv", 8)
        _tsv(root, f"train/{ds}/{model}/embed-cluster-0.31/g1-balanced/s{s}.tsv", 99)
        _tsv(root, f"train/{ds}/{model}/cluster-0.5/g1-balanced/s{s}.tsv", 99)
        _tsv(root, f"train/{ds}/{model}/full-1/g1-balanced/s{s}.tsv", 40)
        _tsv(root, f"features/{ds}/{model}/tfidf/s{s}.tsv", 99)
    _tsv(root, "base_model/m.tsv", 999)
    _tsv(root, "report.tsv", 99)


def test_ratio_is_selection_plus_budget_training_over_full(tmp_path):
    make_run(tmp_path)
    t = overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"))
    assert list(t["seed"]) == [0, 1]
    assert list(t["score_s"]) == [10.0, 11.0]
    assert list(t["overhead_s"]) == [13.0, 14.0]
    assert t["ratio"].tolist() == pytest.approx([(13 + 8) / 40, (14 + 8) / 40], rel=1e-12)
    assert t["train_ratio"].tolist() == pytest.approx([0.2, 0.2])
    assert t["overhead_ratio"].tolist() == pytest.approx([13 / 40, 14 / 40])
    s = overhead.summary(t)
    assert len(s) == 1 and s["n_seeds"].iloc[0] == 2
    assert s["ratio"].iloc[0] == pytest.approx(((13 + 8) / 40 + (14 + 8) / 40) / 2)
    # at another budget: the train and full files are there, its select file is not
    with pytest.raises(InputError, match="no select benchmark file .*budget=0.5"):
        overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"),
                                budget=0.5)


def test_a_job_of_several_seeds_shares_its_seconds_among_them(tmp_path):
    """sweep.accuracy.fuse_seeds: train/.../g1-balanced/s0+1+2.tsv is one job for three
    seeds; each seed's row counts a third of it, for the budget and the full run alike."""
    make_run(tmp_path, seeds=(0, 1, 2))
    for s in (0, 1, 2):
        for part in ("cluster-0.31", "full-1", "embed-cluster-0.31", "cluster-0.5"):
            (tmp_path / f"benchmarks/out/train/ds/m/{part}/g1-balanced/s{s}.tsv").unlink()
    _tsv(tmp_path, "train/ds/m/cluster-0.31/g1-balanced/s0+1+2.tsv", 27)
    _tsv(tmp_path, "train/ds/m/full-1/g1-balanced/s0+1+2.tsv", 90)
    bench = overhead.read_benchmarks(tmp_path / "benchmarks" / "out")
    tr = bench[bench["rule"] == "train"]
    assert sorted(tr["seed"]) == [0, 0, 1, 1, 2, 2] and set(tr["job_seeds"]) == {3}
    t = overhead.overhead_table(bench)
    assert list(t["seed"]) == [0, 1, 2]
    assert t["train_budget_s"].tolist() == pytest.approx([9.0] * 3)
    assert t["train_full_s"].tolist() == pytest.approx([30.0] * 3)
    assert t["ratio"].tolist() == pytest.approx([(10 + s + 3 + 9) / 30 for s in (0, 1, 2)])
    bad = tmp_path / "benchmarks/out/train/ds/m/full-1/g1-balanced/s0+x.tsv"
    _tsv(tmp_path, "train/ds/m/full-1/g1-balanced/s0+x.tsv", 1)
    with pytest.raises(InputError, match="sS\\+S"):
        overhead.read_benchmarks(tmp_path / "benchmarks" / "out")
    bad.unlink()


def test_every_gpu_count_and_distribution_pairs_with_its_own_full_run(tmp_path):
    make_run(tmp_path, seeds=(0,))
    for dist, sub, full in (("random", 5, 20), ("balanced", 4, 16)):
        _tsv(tmp_path, f"train/ds/m/cluster-0.31/g2-{dist}/s0.tsv", sub)
        _tsv(tmp_path, f"train/ds/m/full-1/g2-{dist}/s0.tsv", full)
    _tsv(tmp_path, "train/ds/m/cluster-0.31/g4-random/s0.tsv", 7)  # no full at 4: no row
    t = overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"))
    got = {(r.gpus, r.distribution): r.ratio for r in t.itertuples()}
    assert got == pytest.approx({(1, "balanced"): 21 / 40, (2, "balanced"): 17 / 16,
                                 (2, "random"): 18 / 20})


def test_sharded_score_adds_the_warmup_and_the_slowest_shard(tmp_path):
    make_run(tmp_path, seeds=(0,))
    _tsv(tmp_path, "score_warmup/ds/m/s0.tsv", 3)
    _tsv(tmp_path, "score_shard/ds/m/s0/shard0.tsv", 4)
    _tsv(tmp_path, "score_shard/ds/m/s0/shard1.tsv", 6)
    t = overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"))
    assert t["score_s"].iloc[0] == 10 + 3 + 6
    assert t["ratio"].iloc[0] == pytest.approx((19 + 2 + 1 + 8) / 40)


def test_missing_stage_file_is_named(tmp_path):
    make_run(tmp_path, seeds=(0,))
    (tmp_path / "benchmarks/out/cluster/ds/m/gradient/s0.tsv").unlink()
    with pytest.raises(InputError, match="no cluster benchmark file for dataset=ds, model=m, "
                                         "seed=0, kind=gradient"):
        overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"))


def test_bad_benchmark_file_names_file_and_field(tmp_path):
    make_run(tmp_path, seeds=(0,))
    bad = tmp_path / "benchmarks/out/select/ds/m/cluster-0.31/s0.tsv"
    bad.write_text("seconds\n1.0\n")
    with pytest.raises(InputError) as e:
        overhead.read_benchmarks(tmp_path / "benchmarks" / "out")
    assert str(bad) in str(e.value) and "field 's'" in str(e.value)
    bad.write_text(HEADER + "n/a\t0\t0\t0\t0\t0\t0\t0\t0\t0\n")
    with pytest.raises(InputError, match="seconds must be a number >= 0, got 'n/a'"):
        overhead.read_benchmarks(tmp_path / "benchmarks" / "out")
    _tsv(tmp_path, "select/ds/m/cluster-0.31/s0.tsv", 1)
    with pytest.raises(InputError, match="does not exist"):
        overhead.read_benchmarks(tmp_path / "nowhere")
    odd = tmp_path / "benchmarks/out/train/ds/m/cluster-x/g1-balanced/s0.tsv"
    odd.parent.mkdir(parents=True)
    odd.write_text(HEADER + "1\t0\t0\t0\t0\t0\t0\t0\t0\t0\n")
    with pytest.raises(InputError, match="layout"):
        overhead.read_benchmarks(tmp_path / "benchmarks" / "out")


def make_results(root: Path, seeds=(0,)) -> int:
    """Result files the projection reads; returns the model's parameter count."""
    from safetensors.numpy import save_file

    res = root / "results"
    (res / "models/m/base").mkdir(parents=True)
    save_file({"a": np.zeros((10, 20), np.float32), "b": np.zeros(5, np.float32)},
              str(res / "models/m/base/model.safetensors"))
    for s in seeds:
        for part, wall in (("full-1", 30.0), ("cluster-0.31", 6.0)):
            p = res / f"train/ds/m/{part}/g1-balanced/s{s}/train_metrics.json"
            p.parent.mkdir(parents=True)
            p.write_text(json.dumps({"wall_time_s": wall, "tokens": 15000, "examples": 100,
                                     "epochs": 3}))
        (res / f"score/ds/m/s{s}").mkdir(parents=True)
        np.save(res / f"score/ds/m/s{s}/features.npy", np.ones((100, 8), np.float32))
        (res / f"cluster/ds/m/gradient/s{s}").mkdir(parents=True)
        pd.DataFrame({"id": [f"x{i}" for i in range(100)], "cluster": np.arange(100) % 4}
                     ).to_parquet(res / f"cluster/ds/m/gradient/s{s}/clusters.parquet")
    return 10 * 20 + 5


def test_projection_follows_the_stated_laws(tmp_path):
    make_run(tmp_path, seeds=(0,))
    _tsv(tmp_path, "score/ds/m/s0.tsv", 25)  # job 25 s, fixed part 40 - 30 = 10 s
    assert make_results(tmp_path) == overhead.safetensors_params(
        tmp_path / "results/models/m/base/model.safetensors") == 205
    assert overhead.model_params(tmp_path / "results/models/m/base") == 205
    with pytest.raises(InputError, match="no \\*.safetensors"):
        overhead.model_params(tmp_path / "results")
    t = overhead.overhead_table(overhead.read_benchmarks(tmp_path / "benchmarks" / "out"))
    paper = {"params": [205_000.0], "epochs": 6, "k": 8, "dim": 16, "tokens_per_example": 100,
             "train_gpus": 4, "score_gpus": 1}
    p = overhead.project_to_paper(t, tmp_path / "results", paper).iloc[0]
    assert p["embedded_tokens_per_example"] == 50 and p["embedded_k"] == 4
    assert p["embedded_dim"] == 8 and p["job_fixed_s"] == 10
    # tokens x 2, params x 1000, epochs x 2, k*d x 4, train on 4 GPUs, score on 1:
    train_full, train_budget = 30 * 2000 * 2 / 4, 6 * 2000 * 2 / 4
    score, cluster, select = 15 * 2000, 2 * 4, 1
    assert p["paper_ratio"] == pytest.approx(
        (score + cluster + select + train_budget) / train_full, rel=1e-12)
    assert p["paper_ratio_score_on_all_gpus"] == pytest.approx(
        (score / 4 + cluster + select + train_budget) / train_full, rel=1e-12)
    assert p["paper_train_ratio"] == pytest.approx(0.2)


def test_write_tables_and_report_hook(tmp_path):
    from clusterft.stages.report import run_report

    make_run(tmp_path, seeds=(0, 1))
    make_results(tmp_path, seeds=(0, 1))
    paths = overhead.write_tables(tmp_path, tmp_path / "tables")
    csv = pd.read_csv(tmp_path / "tables" / "selection_overhead.csv")
    assert csv["ratio"].tolist() == pytest.approx([21 / 40, 22 / 40])
    assert {"paper_ratio", "embedded_params", "score_s", "train_full_s"} <= set(csv)
    md = (tmp_path / "tables" / "selection_overhead.md").read_text()
    assert "| ds | m | 1 | balanced | 2 |" in md and "Projected to the paper's scale" in md
    assert [Path(p).name for p in paths] == ["selection_overhead.csv", "selection_overhead.md"]
    # run_report writes them beside the other tables when given the run folder
    tm = tmp_path / "tm.json"
    tm.write_text(json.dumps({"wall_time_s": 1.0, "tokens": 10, "steps": 1, "epochs": 1,
                              "per_rank_tokens_per_step": [[10]]}))
    out = run_report([{"dataset": "ds", "model": "m", "method": "full", "budget": 1.0,
                       "gpus": 1, "distribution": "balanced", "seed": 0,
                       "train_metrics_json": str(tm)}], tmp_path / "rt", tmp_path / "rp",
                     run_dir=tmp_path)
    assert str(tmp_path / "rt" / "selection_overhead.md") in out["tables"]
    assert (tmp_path / "rt" / "selection_overhead.csv").read_text() == \
        (tmp_path / "tables" / "selection_overhead.csv").read_text()


def test_run_without_the_method_says_so(tmp_path):
    _tsv(tmp_path, "train/ds/m/full-1/g1-balanced/s0.tsv", 40)
    overhead.write_tables(tmp_path, tmp_path / "tables")
    assert (tmp_path / "tables" / "selection_overhead.md").read_text().startswith("(no run")
