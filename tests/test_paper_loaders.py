"""config/paper.yaml offline: every hub dataset and every lm-eval task it names is read by
the code a real run uses, from small local files shaped like the hub ones, with the hub
switched off (HF_HUB_OFFLINE=1) and sockets refused; and its dry run lists every job with
its resources without a network.

How a hub id resolves locally: `datasets.load_dataset("<owner>/<name>", ...)` takes a local
folder of that relative path before the hub, and reads a README.md `configs:` block there as
the hub does. So the paper's own dataset sections (hub ids, columns, split, n) and
lm-eval's own task YAMLs (dataset_path, dataset_name, splits, prompt functions) run
unchanged; only the bytes come from a temporary folder. Column names, types and file layout
follow each hub dataset's card (the files were not downloaded to check them).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterft.plan.config import load_config, tasks_for
from clusterft.stages.data.prepare import run_prepare_data
from clusterft.pools.poolfile import load_pool

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "config" / "paper.yaml"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Hub off, every internet socket refused, cwd = a fresh folder for hub-shaped copies."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    real_connect = socket.socket.connect

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"network access in an offline test: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _paper() -> dict:
    return yaml.safe_load(PAPER.read_text(encoding="utf-8"))


def _write(path: Path, rows: list[dict], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":  # one JSON array (CodeAlpaca, medical flashcards)
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        pd.DataFrame(rows).to_parquet(path, index=False)


def _readme(folder: Path, configs: dict[str, dict[str, str]]) -> None:
    """A hub dataset card's `configs:` block: config name -> split -> file."""
    block = [{"config_name": name, "data_files": [{"split": s, "path": p} for s, p in splits.items()]}
             for name, splits in configs.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text("---\n" + yaml.safe_dump({"configs": block}) + "---\n")


# ------------------------------------------------------------------ instruction pools

# hub id -> (file as on the hub, format, rows shaped like the hub's, expected (user, assistant))
POOLS = {
    "sahil2801/CodeAlpaca-20k": (
        "code_alpaca_20k.json", "json",
        [{"instruction": "Create an array of length 5 which contains all even numbers "
                         "between 1 and 10.", "input": "", "output": "arr = [2, 4, 6, 8, 10]"},
         {"instruction": "Write a function to reverse a string.", "input": "s = 'abc'",
          "output": "def rev(s):\n    return s[::-1]"}],
        [("Create an array of length 5 which contains all even numbers between 1 and 10.",
          "arr = [2, 4, 6, 8, 10]"),
         ("Write a function to reverse a string.\n\ns = 'abc'", "def rev(s):\n    return s[::-1]")]),
    "ise-uiuc/Magicoder-OSS-Instruct-75K": (
        "data-oss_instruct-decontaminated.jsonl", "jsonl",
        [{"lang": "python", "raw_index": 7, "index": 0, "seed": "def f(x):\n    pass",
          "openai_fingerprint": "fp_1", "problem": "You are given a list of integers. Return "
          "the sum of the even ones.", "solution": "```python\ndef s(xs):\n    return "
          "sum(x for x in xs if x % 2 == 0)\n```"},
         {"lang": "rust", "raw_index": 9, "index": 1, "seed": "fn main() {}",
          "openai_fingerprint": "fp_1", "problem": "Write a Rust function that adds two "
          "numbers.", "solution": "```rust\nfn add(a: i32, b: i32) -> i32 { a + b }\n```"}],
        [("You are given a list of integers. Return the sum of the even ones.",
          "```python\ndef s(xs):\n    return sum(x for x in xs if x % 2 == 0)\n```"),
         ("Write a Rust function that adds two numbers.",
          "```rust\nfn add(a: i32, b: i32) -> i32 { a + b }\n```")]),
    "medalpaca/medical_meadow_medical_flashcards": (
        "medical_meadow_wikidoc_medical_flashcards.json", "json",
        [{"input": "What is the relationship between very low Mg2+ levels, PTH levels, and "
                   "Ca2+ levels?", "output": "Very low Mg2+ levels correspond to low PTH "
                   "levels which in turn results in low Ca2+ levels.",
          "instruction": "Answer this question truthfully"},
         {"input": "What is the most common cause of community-acquired pneumonia?",
          "output": "Streptococcus pneumoniae.", "instruction": "Answer this question truthfully"}],
        [("Answer this question truthfully\n\nWhat is the relationship between very low Mg2+ "
          "levels, PTH levels, and Ca2+ levels?", "Very low Mg2+ levels correspond to low PTH "
          "levels which in turn results in low Ca2+ levels."),
         ("Answer this question truthfully\n\nWhat is the most common cause of "
          "community-acquired pneumonia?", "Streptococcus pneumoniae.")]),
}


def test_every_paper_pool_loads_offline_through_prepare_data(offline):
    """Each dataset section of config/paper.yaml, unchanged, through the prepare_data stage
    (the loader of every source: clusterft.stages.data.prepare.load_hf_pool) from a hub-shaped local copy."""
    paper = _paper()
    assert {d["hf_dataset"] for d in paper["datasets"].values()} == set(POOLS), \
        "a dataset of config/paper.yaml has no hub-shaped test file here"
    for name, spec in paper["datasets"].items():
        file, fmt, rows, expected = POOLS[spec["hf_dataset"]]
        _write(offline / spec["hf_dataset"] / file, rows, fmt)
        out = offline / "out" / name
        summary = run_prepare_data(name, spec, out / "pool.jsonl", out / "labels.parquet",
                                   out / "tasks", seed=0)
        pool = load_pool(out / "pool.jsonl")
        assert summary["n"] == len(rows) == len(pool), name
        got = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in pool]
        assert got == expected, name
        assert [r["messages"][0]["role"] for r in pool] == ["user"] * len(rows)
        assert [r["id"] for r in pool] == [f"{name}-{i:05d}" for i in range(len(rows))]
        assert {r["source"] for r in pool} == {spec["hf_dataset"]}
        assert list(pd.read_parquet(out / "labels.parquet")["label"]) == ["unlabelled"] * len(rows)


def test_paper_pool_without_its_file_fails_offline_naming_it(offline):
    """No local copy and no cache: a clear error naming the dataset, not a download."""
    from clusterft.pipeline.errors import InputError

    name, spec = next(iter(_paper()["datasets"].items()))
    with pytest.raises(InputError, match=re.escape(spec["hf_dataset"]) + r".*offline runs need"):
        run_prepare_data(name, spec, offline / "p.jsonl", offline / "l.parquet", offline / "t")


# ------------------------------------------------------------------ lm-eval benchmarks

def _mmlu(subject: str) -> dict:
    rows = [{"question": f"Which {subject} answer is right? ", "subject": subject,
             "choices": ["first", "second", "third", "fourth"], "answer": 2},
            {"question": f"Another {subject} question?", "subject": subject,
             "choices": ["w", "x", "y", "z"], "answer": 0}]
    return {"path": "cais/mmlu", "config": subject, "splits": {"test": rows, "validation": rows,
                                                               "dev": rows},
            "text": f"Which {subject} answer is right?\nA. first\nB. second\nC. third\n"
                    "D. fourth\nAnswer:",
            "target": 2, "choices": ["A", "B", "C", "D"]}


HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
              "canonical_solution": "    return a + b\n",
              "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
              "entry_point": "add"}]
MBPP = [{"task_id": 11, "text": "Write a function to add two numbers.",
         "code": "def add(a, b):\r\n  return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"],
         "test_setup_code": "", "challenge_test_list": []}]
MEDQA = [{"id": "q1", "sent1": "A 23-year-old presents with fever. Most likely cause?",
          "sent2": "", "ending0": "Virus", "ending1": "Bacteria", "ending2": "Fungus",
          "ending3": "Prion", "label": 1}]
MEDMCQA = [{"id": "m1", "question": "Which vitamin deficiency causes scurvy?", "opa": "A",
            "opb": "B1", "opc": "C", "opd": "D", "cop": 2, "choice_type": "single",
            "exp": "Vitamin C.", "subject_name": "Medicine", "topic_name": "Vitamins"}]

# lm-eval task -> its hub dataset (path, config or None, split rows) and the expected
# prompt, target and choices of the first test document
BENCHMARKS = {
    "humaneval": {"path": "openai/openai_humaneval", "config": "openai_humaneval",
                  "splits": {"test": HUMANEVAL}, "text": HUMANEVAL[0]["prompt"],
                  "target": HUMANEVAL[0]["test"] + "\ncheck(add)", "choices": None},
    "mbpp": {"path": "google-research-datasets/mbpp", "config": "full",
             "splits": {s: MBPP for s in ("train", "test", "validation", "prompt")},
             "text": "You are an expert Python programmer, and here is your task: Write a "
                     "function to add two numbers. Your code should pass these tests:\n\n"
                     "assert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(2, 2) == 4\n"
                     "[BEGIN]\n",
             "target": "assert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(2, 2) == 4",
             "choices": None},
    "mmlu_college_computer_science": _mmlu("college_computer_science"),
    "mmlu_clinical_knowledge": _mmlu("clinical_knowledge"),
    "mmlu_professional_medicine": _mmlu("professional_medicine"),
    "medqa_4options": {"path": "GBaker/MedQA-USMLE-4-options-hf", "config": None,
                       "splits": {s: MEDQA for s in ("train", "validation", "test")},
                       "text": "Question: A 23-year-old presents with fever. Most likely "
                               "cause?\nA. Virus\nB. Bacteria\nC. Fungus\nD. Prion\nAnswer:",
                       "target": 1, "choices": ["A", "B", "C", "D"]},
    "medmcqa": {"path": "openlifescienceai/medmcqa", "config": None,
                "splits": {s: MEDMCQA for s in ("train", "validation", "test")},
                "text": "Question: Which vitamin deficiency causes scurvy?\nChoices:\nA. A\n"
                        "B. B1\nC. C\nD. D\nAnswer:",
                "target": 2, "choices": ["A", "B", "C", "D"]},
    "mmlu_college_medicine": _mmlu("college_medicine"),
}


def _hub_copies(root: Path) -> None:
    """Each benchmark's dataset as a hub-shaped folder (parquet per split, configs in the
    card; mmlu's subjects share one folder, as on the hub)."""
    cards: dict[str, dict] = {}
    for spec in BENCHMARKS.values():
        config = spec["config"] or "default"
        splits = {}
        for split, rows in spec["splits"].items():
            rel = f"{config}/{split}-00000-of-00001.parquet"
            _write(root / spec["path"] / rel, rows, "parquet")
            splits[split] = rel
        cards.setdefault(spec["path"], {})[config] = splits
    for path, configs in cards.items():
        _readme(root / path, configs)


class _CodeEvalStub:
    """Stands in for `evaluate.load("code_eval")` only: humaneval's and mbpp's metric modules
    fetch that metric script from the hub when imported (a real run needs it cached, or
    allow_downloads, and HF_ALLOW_CODE_EVAL=1, which run_evaluate sets with
    confirm_run_unsafe_code). The datasets and prompts under test do not go through it."""

    def compute(self, references, predictions, k):
        return [{f"pass@{i}": 0.0 for i in k}], {}


def test_every_paper_benchmark_loads_offline_through_lm_eval(offline, monkeypatch):
    """Each lm-eval task of config/paper.yaml, by lm-eval's own task YAML and prompt code,
    reads its hub-shaped local copy and gives the expected test documents and prompts."""
    import evaluate as hf_evaluate
    from lm_eval.tasks import TaskManager

    paper = _paper()
    named = [t for d in paper["datasets"] for t in tasks_for(paper, d)]
    assert set(named) == set(BENCHMARKS), "a task of config/paper.yaml has no hub-shaped file here"
    _hub_copies(offline)
    monkeypatch.setattr(hf_evaluate, "load", lambda name, *a, **k: _CodeEvalStub())
    tasks = TaskManager().load(sorted(BENCHMARKS))["tasks"]
    for name, spec in BENCHMARKS.items():
        task = tasks[name]
        docs = list(task.test_docs())
        test_split = task.config.test_split
        assert len(docs) == len(spec["splits"][test_split]), name
        doc = docs[0]
        assert task.doc_to_text(doc) == spec["text"], name
        assert task.doc_to_target(doc) == spec["target"], name
        if spec["choices"] is not None:
            assert task.doc_to_choice(doc) == spec["choices"], name


def test_paper_multiple_choice_benchmarks_run_end_to_end_offline(offline, tiny_model_dir,
                                                                  monkeypatch):
    """run_evaluate with the paper's evaluate section on its six multiple-choice tasks
    (hub-shaped local copies, the tiny model): results.json names each task's accuracy and
    the per-item rows cover every test document."""
    from clusterft.stages.evaluate import run_evaluate

    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "0")  # restored after the test
    paper = _paper()
    _hub_copies(offline)
    mc = [t for t in BENCHMARKS if BENCHMARKS[t]["choices"] is not None]
    cfg = {**paper["evaluate"], "device": "cpu", "num_threads": 1, "batch_size": 4}
    res = run_evaluate(tiny_model_dir, mc, [offline / "items"], cfg, offline / "e" / "results.json",
                       offline / "e" / "tasks", seed=0, out_items=offline / "e" / "items.parquet")
    assert set(res["tasks"]) == set(mc)
    for name in mc:
        spec = BENCHMARKS[name]
        n = len(spec["splits"]["validation" if name == "medmcqa" else "test"])
        assert (res["tasks"][name]["metric"], res["tasks"][name]["n"]) == ("acc", n), name
    items = pd.read_parquet(offline / "e" / "items.parquet")
    assert sorted(items.groupby("task").size().items()) == sorted(
        (t, res["tasks"][t]["n"]) for t in mc)
    assert os.environ.get("HF_ALLOW_CODE_EVAL") == "1"  # paper: confirm_run_unsafe_code


# ------------------------------------------------------------------ the dry run

def test_paper_dry_run_lists_every_job_with_resources_offline(tmp_path):
    """`snakemake -n --configfile config/paper.yaml` with the hub off: every planned job is
    listed with its resources (GPU jobs with a gpu count), and nothing is downloaded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "*",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n",
         "--directory", str(tmp_path), "--configfile", str(PAPER), "--cores", "8"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    blocks = [b for b in re.split(r"\n(?=\[[^\n]*\]\n(?:local)?rule )", text) if "jobid:" in b]
    counts = {}
    for line in text.split("Job stats:", 1)[1].splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    assert len(blocks) == sum(counts.values()) > 100
    sharded = (_paper().get("evaluate") or {}).get("shards", 1) > 1
    gpu_rules = (("evaluate_shard", "evaluate_base_shard") if sharded
                 else ("evaluate", "evaluate_base"))
    for b in blocks:
        rule = re.search(r"rule (\w+):", b).group(1)
        res = re.search(r"resources: (.*)", b)
        assert res, f"job of rule {rule} lists no resources"
        if rule == "all":  # the target rule: no job runs
            continue
        assert re.search(r"\bmem_mb=\d+", res.group(1)) and \
            re.search(r"\bruntime=\d+", res.group(1)), (rule, res.group(1))
        if rule in gpu_rules:  # paper: train.device cuda, one GPU per evaluation job
            assert re.search(r"\bgpu=1\b", res.group(1)), (rule, res.group(1))
        elif rule in ("evaluate", "evaluate_base"):  # the merge of the shards: CPU only
            assert re.search(r"\bgpu=0\b", res.group(1)), (rule, res.group(1))
    assert counts["evaluate"] > 0 and counts["train"] > 0
    if sharded:
        assert counts["evaluate_shard"] >= 2 * counts["evaluate"]
    assert not list(tmp_path.rglob("*.parquet")), "a dry run wrote data"
