"""Files that belong together: every stage output records where it came from, and every
stage refuses inputs of two different runs, naming both files and the run of each.

Two real small runs (A and B: the same dataset prepared with different seeds, each scored,
clustered and selected with the tiny model; A also trained and evaluated) are made through
the command line; then files of B are swapped into A's commands.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterft", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stderr[-3000:]


def refused(out: subprocess.CompletedProcess, *names: str) -> str:
    """The run stopped with exit code 2 and a one-line error naming every ``names``."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for n in names:
        assert n in out.stderr, (n, out.stderr[-3000:])
    return out.stderr


def make_run(root: Path, name: str, seed: int, model: Path) -> Path:
    d = root / name
    d.mkdir()
    (d / "data.yaml").write_text("items_per_task: 12\n")
    ok(cli("prepare-data", "--dataset", "skills", "--n", "64", "--seed", str(seed), "--config",
           "data.yaml", "--out-pool", "pool.jsonl", "--out-labels", "labels.parquet",
           "--out-items", "bench", cwd=d))
    (d / "score.yaml").write_text("dim: 16\nwarmup_steps: 1\nbatch_size: 16\n")
    ok(cli("score", "--model", str(model), "--pool", "pool.jsonl", "--config", "score.yaml",
           "--out-features", "f.npy", "--out-scores", "s.parquet", cwd=d))
    ok(cli("cluster", "--features", "f.npy", "--scores", "s.parquet", "--k", "3",
           "--out-clusters", "c.parquet", "--out-centroids", "c.npy", cwd=d))
    ok(cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "cluster",
           "--budget", "0.25", "--out-selection", "sel.parquet", "--out-summary", "sel.json",
           cwd=d))
    return d


TRAIN_CFG = json.dumps({"epochs": 1, "batch_size": 8, "max_length": 96})


def train_args(model: Path, pool: Path, sel: Path, out: Path) -> tuple[str, ...]:
    return ("train", "--model", str(model), "--pool", str(pool), "--selection", str(sel),
            "--out", str(out / "model"), "--metrics", str(out / "metrics.json"),
            "--threads", "1", "--config", TRAIN_CFG)


def eval_args(model: Path, items: Path, out: Path) -> tuple[str, ...]:
    (out / "eval.yaml").write_text("limit: 4\nnum_threads: 1\n")
    return ("evaluate", "--model", str(model), "--tasks", "skills_mc", "--items", str(items),
            "--config", str(out / "eval.yaml"), "--out", str(out / "results.json"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    a = make_run(root, "A", 0, tiny_model_dir)
    b = make_run(root, "B", 1, tiny_model_dir)
    ok(cli(*train_args(tiny_model_dir, a / "pool.jsonl", a / "sel.parquet", a), cwd=a))
    ok(cli(*eval_args(a / "model", a / "bench", a), cwd=a))
    return a, b


def test_every_output_records_its_inputs_and_config(runs, tiny_model_dir) -> None:
    a, _ = runs
    for out in ("pool.jsonl", "labels.parquet", "bench", "f.npy", "s.parquet", "c.parquet",
                "c.npy", "sel.parquet", "sel.json", "model", "metrics.json", "results.json"):
        prov = provenance.read(a / out)
        assert prov is not None, out
        assert prov["digest"] == provenance.digest(a / out), out
    f = provenance.read(a / "f.npy")
    assert f["stage"] == "score" and f["config"]["dim"] == 16
    assert f["inputs"]["pool"]["digest"] == provenance.digest(a / "pool.jsonl")
    assert f["inputs"]["model"]["path"] == str(tiny_model_dir)
    assert set(f["lineage"]) >= {"pool", "data[skills]", "tokenizer", "score_run"}
    # siblings of one run share its run key; the trained model and its results carry the
    # pool, the scoring run and the selection along
    assert provenance.read(a / "s.parquet")["lineage"]["score_run"] == f["lineage"]["score_run"]
    res = provenance.read(a / "results.json")["lineage"]
    assert res["selection"] == provenance.read(a / "sel.parquet")["lineage"]["selection"]
    assert res["data[skills]"] == provenance.read(a / "bench")["lineage"]["data[skills]"]
    sel = provenance.read(a / "sel.parquet")
    assert sel["config"]["method"] == "cluster" and sel["config"]["budget"] == 0.25


def test_cluster_refuses_features_and_scores_of_two_score_runs(runs, tmp_path) -> None:
    a, b = runs
    err = refused(cli("cluster", "--features", str(a / "f.npy"), "--scores", str(b / "s.parquet"),
                      "--k", "3", "--out-clusters", "c.parquet", "--out-centroids", "c.npy",
                      cwd=tmp_path), str(a / "f.npy"), str(b / "s.parquet"),
                  "do not belong together", "written by score")
    assert not (tmp_path / "c.parquet").exists()
    # the first difference along the chain: A and B were prepared apart
    assert "different prepare_data runs" in err and str(a / "pool.jsonl") in err


def test_cluster_refuses_two_score_runs_of_the_same_pool(runs, tiny_model_dir, tmp_path) -> None:
    a, _ = runs
    (tmp_path / "score.yaml").write_text("dim: 16\nwarmup_steps: 1\nbatch_size: 16\n")
    ok(cli("score", "--model", str(tiny_model_dir), "--pool", str(a / "pool.jsonl"), "--seed",
           "1", "--config", "score.yaml", "--out-features", "f.npy", "--out-scores", "s.parquet",
           cwd=tmp_path))
    refused(cli("cluster", "--features", str(a / "f.npy"), "--scores", str(tmp_path / "s.parquet"),
                "--k", "3",
                "--out-clusters", "c.parquet", "--out-centroids", "c.npy", cwd=tmp_path),
            str(a / "f.npy"), str(tmp_path / "s.parquet"), "different score runs", "seed 1",
            "seed 0")


def test_select_refuses_clusters_of_other_scores(runs, tmp_path) -> None:
    a, b = runs
    refused(cli("select", "--clusters", str(a / "c.parquet"), "--scores", str(b / "s.parquet"),
                "--method", "cluster", "--budget", "0.25", "--out-selection", "x.parquet",
                "--out-summary", "x.json", cwd=tmp_path),
            str(a / "c.parquet"), str(b / "s.parquet"), "do not belong together")
    assert not (tmp_path / "x.parquet").exists()


def test_a_file_swapped_in_without_its_sidecar_is_refused(runs, tmp_path) -> None:
    a, b = runs
    mixed = tmp_path / "mixed"
    shutil.copytree(a, mixed, ignore=shutil.ignore_patterns("model", "model.ckpt"))
    shutil.copyfile(b / "f.npy", mixed / "f.npy")  # the features of B, A's sidecar left
    refused(cli("cluster", "--features", "f.npy", "--scores", "s.parquet", "--k", "3",
                "--out-clusters", "c2.parquet", "--out-centroids", "c2.npy", cwd=mixed),
            "f.npy", "replaced or edited after", "written by score")


def test_train_refuses_a_selection_of_another_pool(runs, tiny_model_dir, tmp_path) -> None:
    a, b = runs
    refused(cli(*train_args(tiny_model_dir, a / "pool.jsonl", b / "sel.parquet", tmp_path),
                cwd=tmp_path), str(a / "pool.jsonl"), str(b / "sel.parquet"),
            "do not belong together")
    assert not (tmp_path / "model").exists()
    # the same prepare run, but a pool edited after scoring (a user's copy, no sidecar)
    lines = (a / "pool.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "edited.jsonl").write_text("".join(lines[:-1]))
    refused(cli(*train_args(tiny_model_dir, tmp_path / "edited.jsonl", a / "sel.parquet",
                            tmp_path), cwd=tmp_path),
            str(tmp_path / "edited.jsonl"), str(a / "sel.parquet"), "different pools")


def test_train_refuses_a_selection_naming_ids_not_in_the_pool(runs, tiny_model_dir,
                                                              tmp_path) -> None:
    """A user's own selection file (no sidecar) is still checked against the pool."""
    import pandas as pd

    a, _ = runs
    sel = pd.read_parquet(a / "sel.parquet")
    sel.loc[0, "id"] = "not-a-pool-id"
    sel.to_parquet(tmp_path / "own.parquet", index=False)
    refused(cli(*train_args(tiny_model_dir, a / "pool.jsonl", tmp_path / "own.parquet",
                            tmp_path), cwd=tmp_path), "'not-a-pool-id'", "is not in the pool")


def test_train_refuses_a_model_whose_tokenizer_is_not_the_scoring_one(
        runs, tiny_model_dir, tiny_corpus_path, tmp_path) -> None:
    a, _ = runs
    ok(cli("tokenizer", "--corpus", str(tiny_corpus_path), "--vocab-size", "300", "--out", "tok",
           cwd=tmp_path))
    (tmp_path / "m.yaml").write_text("pretrain: {steps: 0}\n")
    ok(cli("base-model", "--tokenizer", "tok", "--corpus", str(tiny_corpus_path), "--config",
           "m.yaml", "--out", "other", cwd=tmp_path))
    refused(cli(*train_args(tmp_path / "other", a / "pool.jsonl", a / "sel.parquet", tmp_path),
                cwd=tmp_path), str(tmp_path / "other"), str(a / "sel.parquet"), "tokenizers")


def test_a_model_folder_without_weights_is_refused(runs, tiny_model_dir, tmp_path) -> None:
    a, _ = runs
    half = tmp_path / "half"
    shutil.copytree(tiny_model_dir, half, ignore=shutil.ignore_patterns("*.safetensors"))
    refused(cli("score", "--model", str(half), "--pool", str(a / "pool.jsonl"), "--out-features",
                "f.npy", "--out-scores", "s.parquet", cwd=tmp_path), str(half), "no weights")
    refused(cli(*eval_args(half, a / "bench", tmp_path), cwd=tmp_path), str(half), "no weights")


def test_evaluate_refuses_items_drawn_for_another_pool(runs, tmp_path) -> None:
    a, b = runs
    refused(cli(*eval_args(a / "model", b / "bench", tmp_path), cwd=tmp_path),
            str(a / "model"), str(b / "bench"), "prepare_data runs", "data[skills]")
    assert not (tmp_path / "results.json").exists()


def test_decontaminate_refuses_items_of_another_prepare_run(runs, tmp_path) -> None:
    from clusterft.stages.data.decontaminate import run_decontaminate

    a, b = runs
    with pytest.raises(InputError, match="prepare_data runs") as e:
        run_decontaminate("skills", a / "pool.jsonl", [b / "bench"], {}, tmp_path / "p.jsonl",
                          tmp_path / "c.csv")
    assert str(a / "pool.jsonl") in str(e.value) and str(b / "bench") in str(e.value)
    run_decontaminate("skills", a / "pool.jsonl", [a / "bench"], {"action": "drop"},
                      tmp_path / "p.jsonl", tmp_path / "c.csv")
    prov = provenance.read(tmp_path / "p.jsonl")
    assert prov["lineage"]["data[skills]"] == provenance.read(a / "pool.jsonl")["lineage"][
        "data[skills]"]


def test_files_without_provenance_are_accepted(runs, tmp_path) -> None:
    """A user's own files carry no sidecar: nothing to compare, so the stage runs."""
    a, _ = runs
    for name in ("c.parquet", "s.parquet"):
        shutil.copyfile(a / name, tmp_path / name)
    ok(cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "random",
           "--budget", "0.5", "--out-selection", "x.parquet", "--out-summary", "x.json",
           cwd=tmp_path))
    assert provenance.read(tmp_path / "x.parquet")["lineage"].keys() >= {"selection"}


def test_large_files_are_digested_by_sample(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(provenance, "SAMPLE_ABOVE", 1000)
    monkeypatch.setattr(provenance, "SAMPLE_BYTES", 100)
    p = tmp_path / "big.bin"
    p.write_bytes(bytes(5000))
    d0 = provenance.digest(p)
    p.write_bytes(bytes(4999) + b"\1")  # the last bytes change
    assert provenance.digest(p) != d0
    p.write_bytes(bytes(6000))  # the size changes
    assert provenance.digest(p) != d0
