"""The bad-input corpus (tests/bad_inputs/): every broken pool file and config gives an
InputError that names the file, the line (or record) and the field, before any expensive
stage; a few configs also through the Snakefile (`snakemake -n` fails, its output names them).

data/*.jsonl: broken pool files (and pools that end up empty, too long, contaminated);
bench/: a toy benchmark task; config/*.yaml: overlays on the smoke config (.test/config.yaml),
`@BAD@` standing for this folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterft.plan.config import load_config
from clusterft.pools.poolfile import load_pool
from clusterft.stages.data.decontaminate import run_decontaminate
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_parquet

ROOT = Path(__file__).resolve().parents[1]
BAD = Path(__file__).resolve().parent / "bad_inputs"
SMOKE = ROOT / ".test" / "config.yaml"


def check(err: InputError, path: str | Path, line: int | None, field: str, pattern: str) -> str:
    """The message names the file, the line (if any), the field and says what is wrong."""
    msg = str(err)
    assert str(path) in msg and err.path == str(path), msg
    if line is not None:
        assert f"line {line}" in msg and err.line == line, msg
    assert f"field '{field}'" in msg and err.field == field, msg
    assert re.search(pattern, msg), msg
    return msg


# ------------------------------------------------------------------------------- data

DATA = [
    # file, line, field, message pattern
    ("malformed_json.jsonl", 2, "(record)", r"malformed JSON: Expecting .* \(character \d+ of the line\)"),
    ("missing_messages.jsonl", 2, "messages", r"missing; expected a list"),
    ("missing_role.jsonl", 3, "messages[0].role", r"missing role"),
    ("no_user_message.jsonl", 1, "messages", r"at least one user message"),
    ("assistant_not_last.jsonl", 2, "messages[1].role", r"last message must be the assistant"),
    ("empty_content.jsonl", 3, "messages[1].content", r"non-empty string"),
    ("non_utf8.jsonl", 2, "messages[0].content", r"not valid UTF-8 .*save the file as UTF-8"),
    ("duplicate_ids.jsonl", 3, "id", r"duplicate id 'ex-0' \(first seen on line 1\)"),
    ("blank_only.jsonl", None, "(record)", r"pool is empty"),
]


@pytest.mark.parametrize("name,line,field,pattern", DATA, ids=[d[0] for d in DATA])
def test_bad_pool_file(name, line, field, pattern) -> None:
    path = BAD / "data" / name
    with pytest.raises(InputError) as ei:
        load_pool(path)
    check(ei.value, path, line, field, pattern)


def test_non_utf8_file_really_is_not_utf8() -> None:
    raw = (BAD / "data" / "non_utf8.jsonl").read_bytes()
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")


def test_missing_pool_file() -> None:
    path = BAD / "data" / "does_not_exist.jsonl"
    with pytest.raises(InputError, match="pool file does not exist") as ei:
        load_pool(path)
    assert str(path) in str(ei.value)


# ------------------------------------------------------------------ examples too long

def _train(tmp_path, model_dir, name: str, truncation: str, max_length: int = 48):
    from clusterft.stages.train import run_train

    pool = BAD / "data" / name
    ids = [json.loads(x)["id"] for x in pool.read_text().splitlines() if x.strip()]
    sel = tmp_path / f"{name}.sel.parquet"
    write_parquet(sel, pd.DataFrame({"id": ids, "cluster": [0] * len(ids), "score": 0.0}))
    cfg = {"batch_size": 2, "epochs": 1, "max_length": max_length, "truncation": truncation}
    return run_train(model_dir, pool, sel, tmp_path / f"{name}.{truncation}", tmp_path / "m.json",
                     "random", 0, cfg), pool


def test_too_long_error_policy_names_file_line_and_record(tmp_path, tiny_model_dir) -> None:
    with pytest.raises(InputError) as ei:
        _train(tmp_path, tiny_model_dir, "too_long.jsonl", "error")
    check(ei.value, BAD / "data" / "too_long.jsonl", 2, "messages",
          r"record id 'ex-1': example is \d+ tokens, longer than max_length = 48")


def test_too_long_truncate_and_reject_are_counted(tmp_path, tiny_model_dir) -> None:
    m, _ = _train(tmp_path, tiny_model_dir, "too_long.jsonl", "truncate")
    assert m["truncated_examples"] == 1 and m["rejected_examples"] == 0 and m["examples"] == 3
    m, _ = _train(tmp_path, tiny_model_dir, "too_long.jsonl", "reject")
    assert m["truncated_examples"] == 0 and m["rejected_examples"] == 1 and m["examples"] == 2


def test_pool_empty_after_rejecting_too_long(tmp_path, tiny_model_dir) -> None:
    with pytest.raises(InputError) as ei:
        _train(tmp_path, tiny_model_dir, "all_too_long.jsonl", "reject")
    check(ei.value, BAD / "data" / "all_too_long.jsonl", None, "train.max_length",
          r"all 2 selected records \(pool lines 1-2\) are longer than max_length = 48")


def test_score_applies_trains_length_policy_before_any_gradient_work(tmp_path,
                                                                     tiny_model_dir) -> None:
    """The over-long checks stop the run at score (before its model loads), not at train."""
    from clusterft.stages.score import run_score

    feats, scores = tmp_path / "f.npy", tmp_path / "s.parquet"
    path = BAD / "data" / "too_long.jsonl"
    with pytest.raises(InputError) as ei:
        run_score(tiny_model_dir, path, {"dim": 8}, feats, scores,
                  length_policy={"max_length": 48, "truncation": "error"})
    check(ei.value, path, 2, "messages",
          r"record id 'ex-1': example is \d+ tokens, longer than max_length = 48")
    path = BAD / "data" / "all_too_long.jsonl"
    with pytest.raises(InputError) as ei:
        run_score(tiny_model_dir, path, {"dim": 8}, feats, scores,
                  length_policy={"max_length": 48, "truncation": "reject"})
    check(ei.value, path, None, "train.max_length",
          r"all 2 records are longer than max_length = 48 .*nothing left to train on")
    assert not feats.exists() and not scores.exists()


def test_length_policy_counts_what_train_will_cut_or_drop(tiny_model_dir) -> None:
    from clusterft.pools.poolfile import load_pool
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.tokenize import check_length_policy

    tok = load_tokenizer(tiny_model_dir)
    path = BAD / "data" / "too_long.jsonl"
    recs = load_pool(path)
    for policy in ("truncate", "reject"):
        assert check_length_policy(tok, recs, 48, policy, str(path)) == {"n": 3, "too_long": 1}
    assert check_length_policy(tok, recs, 4096, "error", str(path)) == {"n": 3, "too_long": 0}


# --------------------------------------------------------------------- contamination

def test_planted_benchmark_item_is_dropped_and_counted(tmp_path) -> None:
    out_pool, out_csv = tmp_path / "pool.jsonl", tmp_path / "c.csv"
    rows = run_decontaminate("mine", BAD / "data" / "contaminated.jsonl", [BAD / "bench"], {},
                             out_pool, out_csv)
    assert [r["id"] for r in load_pool(out_pool)] == ["ex-0", "ex-2"]
    (row,) = rows
    assert row["task"] == "toy_words" and row["exact"] == 1 and row["dropped"] == 1
    assert row["remaining"] == 0
    table = pd.read_csv(out_csv)
    assert table.loc[0, ["dataset", "task", "exact", "dropped", "remaining"]].tolist() == \
        ["mine", "toy_words", 1, 1, 0]


def test_flagged_overlap_above_threshold_fails_naming_pool_task_count(tmp_path) -> None:
    path = BAD / "data" / "contaminated.jsonl"
    with pytest.raises(InputError) as ei:
        run_decontaminate("mine", path, [BAD / "bench"], {"action": "flag"},
                          tmp_path / "p.jsonl", tmp_path / "c.csv")
    check(ei.value, path, 2, "tasks.max_overlap",
          r"pool 'mine' still has 1 examples overlapping benchmark task 'toy_words' "
          r"\(1 exact.*record 'ex-1'.*max_overlap = 0")
    assert not (tmp_path / "p.jsonl").exists()
    rows = run_decontaminate("mine", path, [BAD / "bench"], {"action": "flag", "max_overlap": 1},
                             tmp_path / "p.jsonl", tmp_path / "c.csv")
    assert rows[0]["remaining"] == 1 and len(load_pool(tmp_path / "p.jsonl")) == 3


def test_pool_empty_after_decontamination(tmp_path) -> None:
    path = BAD / "data" / "all_contaminated.jsonl"
    with pytest.raises(InputError) as ei:
        run_decontaminate("mine", path, [BAD / "bench"], {}, tmp_path / "p.jsonl",
                          tmp_path / "c.csv")
    check(ei.value, path, None, "tasks.decontaminate",
          r"empty after decontamination: all 2 records \(lines 1-2\)")


# ------------------------------------------------------------------------------ config

CONFIG = [
    # overlay, field, token on the reported line, message pattern
    ("unknown_top_key", "colour", "colour", r"unknown key 'colour'; allowed here: .*datasets"),
    ("unknown_stage_key", "score.dims", "dims", r"unknown key 'dims'; allowed here: .*dim"),
    ("budget_zero", "sweep.budgets.0", "0", r"less than or equal to the minimum of 0"),
    ("budget_above_one", "sweep.budgets.1", "1.5", r"1.5 is greater than the maximum of 1"),
    ("gpus_zero", "sweep.accuracy.gpus", "gpus", r"0 is less than the minimum of 1"),
    ("time_gpus_negative", "sweep.time.gpus.1", "-1", r"-1 is less than the minimum of 1"),
    ("k_larger_than_n", "datasets.cipher.n", "n:", r"cluster.k = 500 is larger than the pool size n = 200"),
    ("k_larger_than_jsonl", "cluster.k", "k:",
     r"cluster.k = 4 is larger than the pool of dataset 'mine': .*small_pool.jsonl holds 3 records"),
    ("model_path_missing", "models.tiny.path", "path:",
     r"model path '/nonexistent/cluster-ft/model' does not exist"),
    ("undefined_task", "tasks.only[1]", "mmlu_nope", r"benchmark task 'mmlu_nope' is not defined"),
    ("unknown_method", "sweep.methods.1", "kmeans", r"'kmeans' is not one of \['full', 'random', 'cluster', 'embed-cluster'"),
    ("unknown_time_method", "sweep.time.methods.1", "kmeans", r"'kmeans' is not one of"),
    ("unknown_distribution", "sweep.accuracy.distribution", "roundrobin",
     r"'roundrobin' is not one of \['random', 'balanced'\]"),
    ("unknown_time_distribution", "sweep.time.distributions.1", "zigzag", r"'zigzag' is not one of"),
    ("missing_dataset_file", "datasets.mine.path", "path:",
     r"dataset file '.*does_not_exist.jsonl' does not exist"),
    ("unknown_truncation", "train.truncation", "truncation", r"unknown truncation policy 'chop'"),
    ("unknown_decontaminate", "tasks.decontaminate", "ignore", r"'ignore' is not one of \['drop', 'flag'\]"),
]


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def bad_config(name: str, tmp_path: Path) -> Path:
    """The smoke config with the overlay applied, written (keys sorted) to tmp_path."""
    over = yaml.safe_load((BAD / "config" / f"{name}.yaml").read_text().replace("@BAD@", str(BAD)))
    cfg = deep_merge(yaml.safe_load(SMOKE.read_text()), over)
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.parametrize("name,field,token,pattern", CONFIG, ids=[c[0] for c in CONFIG])
def test_bad_config(name, field, token, pattern, tmp_path) -> None:
    path = bad_config(name, tmp_path)
    with pytest.raises(InputError) as ei:
        load_config(path)
    err = ei.value
    check(err, path, err.line, field, pattern)
    assert err.line is not None, str(err)
    assert token in path.read_text().splitlines()[err.line - 1], (str(err), token)


def test_every_config_overlay_is_tested() -> None:
    assert sorted(p.stem for p in (BAD / "config").glob("*.yaml")) == sorted(c[0] for c in CONFIG)


def test_every_data_file_is_used() -> None:
    used = {d[0] for d in DATA} | {"too_long.jsonl", "all_too_long.jsonl", "small_pool.jsonl",
                                   "contaminated.jsonl", "all_contaminated.jsonl"}
    assert {p.name for p in (BAD / "data").glob("*.jsonl")} == used


SNAKEFILE_CASES = ["unknown_stage_key", "unknown_time_method", "time_gpus_negative",
                   "k_larger_than_jsonl", "model_path_missing"]


@pytest.mark.parametrize("name", SNAKEFILE_CASES)
def test_bad_config_stops_the_snakefile(name, tmp_path) -> None:
    field, _, pattern = next(c[1:] for c in CONFIG if c[0] == name)
    path = bad_config(name, tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"),
                          "--directory", str(tmp_path), "--configfile", str(path)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    text = out.stdout + out.stderr  # Snakemake logs the error to stdout
    assert out.returncode != 0
    assert f"{path}, line " in text and f"field '{field}'" in text, text[-2000:]
    assert re.search(pattern, text), text[-2000:]
    assert not (tmp_path / "results").exists()  # no job ran
