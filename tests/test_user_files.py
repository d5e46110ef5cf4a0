"""Files as users' tools write them: a UTF-8 byte-order mark (Windows), CRLF line ends,
blank trailing lines, a last line without a newline. Every reader of user files (pools,
configs, stage --config files, task items, run tables, corpora) reads each variant exactly
as the plain file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / ".test" / "config.yaml"

VARIANTS = {
    "bom": lambda t: "\ufeff" + t,
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "blank_trailing_lines": lambda t: t + "\n\n  \n",
    "no_final_newline": lambda t: t.rstrip("\n"),
    "all_at_once": lambda t: "\ufeff" + (t.rstrip("\n") + "\n\n\n").replace("\n", "\r\n").rstrip("\r\n"),
}


def variants(tmp_path: Path, name: str, text: str) -> dict[str, Path]:
    """The plain file and each variant, written as bytes (no newline translation)."""
    out = {}
    for key, fn in {"plain": lambda t: t, **VARIANTS}.items():
        p = tmp_path / key / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(fn(text).encode("utf-8"))
        out[key] = p
    return out


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


POOL = [{"id": f"ex-{i}", "messages": [{"role": "user", "content": f"Sort {i} numbers, é"},
                                        {"role": "assistant", "content": f"sorted({i})"}],
         "source": "mine"} for i in range(3)]
ITEMS = [{"id": f"it-{i}", "prompt": f"### Instruction:\nQ{i}\n\n### Response:\n",
          "choices": ["a", "b", "c"], "label": i % 3} for i in range(4)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pool(tmp_path, variant):
    from clusterft.pools.poolfile import load_pool

    files = variants(tmp_path, "pool.jsonl", jsonl(POOL))
    assert load_pool(files[variant]) == load_pool(files["plain"]) == POOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_task_items_and_what_lm_eval_reads(tmp_path, variant):
    import datasets

    from clusterft.stages.evaluate import validate_items, write_task_yamls
    from clusterft.pipeline.io import read_jsonl, set_offline_env

    files = variants(tmp_path, "mine_mc.jsonl", jsonl(ITEMS))
    assert read_jsonl(files[variant]) == read_jsonl(files["plain"]) == ITEMS
    assert validate_items(files[variant], "multiple_choice") == ITEMS
    out = tmp_path / "yamls"
    import yaml

    [y] = write_task_yamls(["mine_mc"], files[variant].parent, out)
    data_file = yaml.safe_load(Path(y).read_text())["dataset_kwargs"]["data_files"]["test"]
    raw = Path(data_file).read_bytes()
    assert not raw.startswith(b"\xef\xbb\xbf") and b"\r" not in raw
    set_offline_env()
    rows = datasets.load_dataset("json", data_files=data_file, split="train").to_list()
    assert rows == ITEMS  # the loader lm-eval uses sees the same items


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_project_config_keeps_values_and_line_numbers(tmp_path, variant):
    from clusterft.plan.config import load_config, yaml_line

    files = variants(tmp_path, "config.yaml", SMOKE.read_text(encoding="utf-8"))
    assert load_config(files[variant]) == load_config(files["plain"])
    for field in ("score.dim", "sweep.time.gpus", "models.tiny.pretrain"):
        assert yaml_line(files[variant], field) == yaml_line(files["plain"], field) is not None


@pytest.mark.parametrize("variant", ["bom", "all_at_once"])
def test_snakemake_reads_the_config_too(tmp_path, variant):
    files = variants(tmp_path, "config.yaml", SMOKE.read_text(encoding="utf-8"))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n",
                           "--directory", str(tmp_path / "wd"), "--configfile", str(files[variant]),
                           "--cores", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prepare_data" in proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stage_config_file(tmp_path, variant):
    from clusterft.pipeline.sections import parse_section_arg

    files = variants(tmp_path, "train.yaml", "train:\n  epochs: 2\n  lr: 1.0e-3\n")
    assert parse_section_arg(str(files[variant]), "train") == {"epochs": 2, "lr": 1.0e-3}


def test_an_inline_section_longer_than_a_file_name_is_read_as_a_mapping():
    """The paper's train sections, passed inline by the rules, outgrow a file name (255
    bytes): read as the mapping they are, not looked up as a file (OSError before)."""
    import json

    from clusterft.pipeline.sections import parse_section_arg

    cfg = {"lora": {"target_modules": [f"module_{i}" for i in range(40)]}, "lr": 2e-5}
    text = json.dumps(cfg)
    assert len(text) > 255
    assert parse_section_arg(text, "train") == cfg


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_run_tables(tmp_path, variant):
    from clusterft.pipeline.io import read_json
    from clusterft.stages.report import read_run_table

    runs = [{"dataset": "d", "model": "m", "method": "full", "budget": 1.0, "seed": 0}]
    js = variants(tmp_path, "runs.json", json.dumps(runs, indent=1) + "\n")
    assert read_json(js[variant]) == runs
    csv = variants(tmp_path, "runs.csv", "dataset,model,method,budget,seed\nd,m,full,1.0,0\n")
    assert read_run_table(csv[variant]) == read_run_table(csv["plain"]) == runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_corpus_and_excluded_texts(tmp_path, variant):
    from clusterft.stages.data.corpus import exclude_texts
    from clusterft.stages.models import read_corpus

    files = variants(tmp_path, "corpus.txt", "first doc\nline two\n\n\n\nsecond doc\n")
    assert read_corpus(files[variant]) == read_corpus(files["plain"]) == ["first doc\nline two",
                                                                           "second doc"]
    pools = variants(tmp_path, "pool.jsonl", jsonl(POOL))
    assert exclude_texts([pools[variant]]) == exclude_texts([pools["plain"]])
