"""The named lm-eval tasks as benchmark items (clusterft.stages.data.benchmark_docs,
clusterft.tasks.lm_eval_docs), offline: hub-shaped local copies of each task's dataset in
the download rule's mirror layout (clusterft.pipeline.mirror), read through lm-eval's own
task definitions. Their test documents become items that decontaminate checks hub pools
against, and their dev splits LESS's / RDS+'s targets; a task that cannot be read is
reported as not checked, never as 0 overlaps."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterft.pipeline.io import read_jsonl
from clusterft.pipeline.mirror import write_dataset
from clusterft.stages.data.benchmark_docs import SUMMARY, run_benchmark_docs
from clusterft.tasks import lm_eval_docs
from clusterft.tasks.registry import val_file
# the hub-off fixture and the code_eval stand-in of the paper loaders' tests
from test_paper_loaders import PAPER, POOLS, _CodeEvalStub, offline  # noqa: F401

TASKS = ["mmlu_college_medicine", "medqa_4options", "medmcqa", "humaneval", "mbpp"]
MISSING = "mmlu_anatomy"  # named, but its data is not in the mirror


def words(tag: str, i: int, n: int = 14) -> str:
    """A sentence of n words that no other (tag, i) shares a word with."""
    return " ".join(f"{tag}{i}w{j}" for j in range(n))


def mmlu(tag: str, i: int) -> dict:
    return {"question": words(tag, i), "subject": "college_medicine",
            "choices": [f"{tag}{i}c{k}" for k in range(4)], "answer": i % 4}


def medqa(tag: str, i: int) -> dict:
    return {"id": f"{tag}{i}", "sent1": words(tag, i), "sent2": "",
            **{f"ending{k}": f"{tag}{i}e{k}" for k in range(4)}, "label": i % 4}


def medmcqa(tag: str, i: int, cop: int | None = None) -> dict:
    return {"id": f"{tag}{i}", "question": words(tag, i),
            **{f"op{x}": f"{tag}{i}o{x}" for x in "abcd"}, "cop": i % 4 if cop is None else cop,
            "choice_type": "single", "exp": "", "subject_name": "Medicine", "topic_name": "t"}


def mbpp(tag: str, i: int) -> dict:
    return {"task_id": i, "text": words(tag, i), "code": f"def f{tag}{i}(a):\r\n  return a + {i}",
            "test_list": [f"assert f{tag}{i}({k}) == {k + i}" for k in range(3)],
            "test_setup_code": "", "challenge_test_list": []}


MMLU_TEST = [mmlu("mt", i) for i in range(3)]
MMLU_DEV = [mmlu("md", 0), MMLU_TEST[1], mmlu("md", 2), mmlu("md", 3)]  # one is a test doc
MEDQA = {"train": [medqa("qt", 0)], "validation": [medqa("qv", i) for i in range(8)],
         "test": [medqa("qs", i) for i in range(2)]}
MEDMCQA = {"train": [medmcqa("ct", i) for i in range(8)],
           "validation": [medmcqa("cv", i) for i in range(2)],
           "test": [medmcqa("cs", i, cop=-1) for i in range(2)]}  # the hub's: no answers
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
              "canonical_solution": "    return a + b\n",
              "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
              "entry_point": "add"}]
MBPP = {"test": [mbpp("bt", i) for i in range(2)], "prompt": [mbpp("bp", i) for i in range(3)],
        "train": [mbpp("br", 0)], "validation": [mbpp("bv", 0)]}


def write_mirror(root: Path) -> None:
    """The tasks' datasets (not mmlu's anatomy subject) in the mirror's hub layout."""
    origin = {"kind": "standin", "built_from": "tests/test_lm_eval_docs.py"}
    write_dataset(root, "cais/mmlu", "college_medicine",
                  {"test": MMLU_TEST, "validation": MMLU_TEST[:1], "dev": MMLU_DEV}, origin)
    write_dataset(root, "GBaker/MedQA-USMLE-4-options-hf", None, MEDQA, origin)
    write_dataset(root, "openlifescienceai/medmcqa", None, MEDMCQA, origin)
    write_dataset(root, "openai/openai_humaneval", "openai_humaneval", {"test": HUMANEVAL},
                  origin)
    write_dataset(root, "google-research-datasets/mbpp", "full", MBPP, origin)


@pytest.fixture
def docs(offline, monkeypatch):
    """run_benchmark_docs over the mirror (in `offline`'s folder): (mirror, out, summary)."""
    import evaluate as hf_evaluate

    monkeypatch.setattr(hf_evaluate, "load", lambda name, *a, **k: _CodeEvalStub())
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    root = offline / "mirror"
    write_mirror(root)
    out = offline / "lm-eval"
    summary = run_benchmark_docs([*TASKS, MISSING], out, mirror=root, val_per_task=5, seed=0,
                                 confirm_run_unsafe_code=True)
    return root, out, summary


def test_test_documents_and_dev_items_of_each_named_task(docs) -> None:
    root, out, summary = docs
    assert json.loads((out / SUMMARY).read_text()) == summary
    tasks = summary["tasks"]
    # the test documents: the split lm-eval evaluates, prompts as lm-eval writes them
    mm = read_jsonl(out / "mmlu_college_medicine.jsonl")
    assert [it["id"] for it in mm] == [f"mmlu_college_medicine-{i:05d}" for i in range(3)]
    assert mm[0] == {"id": "mmlu_college_medicine-00000",
                     "prompt": f"{words('mt', 0)}\nA. mt0c0\nB. mt0c1\nC. mt0c2\nD. mt0c3\n"
                               "Answer:", "choices": ["A", "B", "C", "D"], "label": 0}
    qa = read_jsonl(out / "medqa_4options.jsonl")
    assert [it["prompt"].split("\n")[0] for it in qa] == \
        [f"Question: {r['sent1']}" for r in MEDQA["test"]]
    assert [it["label"] for it in qa] == [r["label"] for r in MEDQA["test"]]
    mc = read_jsonl(out / "medmcqa.jsonl")  # lm-eval scores medmcqa's validation split
    assert [it["prompt"].split("\n")[0] for it in mc] == \
        [f"Question: {r['question']}" for r in MEDMCQA["validation"]]
    he = read_jsonl(out / "humaneval.jsonl")  # code tasks: the reference program
    assert he == [{"id": "humaneval-00000", "prompt": HUMANEVAL[0]["prompt"],
                   "answer": HUMANEVAL[0]["canonical_solution"]}]
    mb = read_jsonl(out / "mbpp.jsonl")
    assert [it["answer"] for it in mb] == [r["code"].replace("\r\n", "\n") for r in MBPP["test"]]
    assert mb[0]["prompt"].startswith("You are an expert Python programmer, and here is your "
                                      f"task: {MBPP['test'][0]['text']}")
    assert {t: tasks[t]["n"] for t in TASKS} == {"mmlu_college_medicine": 3, "medqa_4options": 2,
                                                  "medmcqa": 2, "humaneval": 1, "mbpp": 2}

    # dev items: each task's own dev split, never the evaluated one; a dev item equal to
    # a test document is dropped (MMLU's second dev row)
    assert {t: tasks[t]["dev_split"] for t in TASKS} == {
        "mmlu_college_medicine": "dev", "medqa_4options": "validation", "medmcqa": "train",
        "humaneval": None, "mbpp": "prompt"}
    dev = {t: read_jsonl(val_file(out, t)) for t in TASKS}
    assert [it["prompt"].split("\n")[0] for it in dev["mmlu_college_medicine"]] == \
        [words("md", i) for i in (0, 2, 3)]
    assert tasks["mmlu_college_medicine"]["dev"] == 3
    assert tasks["mmlu_college_medicine"]["dev_dropped"] == {"exact": 1}
    assert [it["id"] for it in dev["medqa_4options"]] == \
        [f"medqa_4options-dev-{j:04d}" for j in range(5)]
    picked = lm_eval_docs.sample(8, 5, seed=0)  # 5 of the 8 validation docs, seeded
    assert picked != list(range(5)) and len(set(picked)) == 5
    assert [it["prompt"].split("\n")[0] for it in dev["medqa_4options"]] == \
        [f"Question: {MEDQA['validation'][i]['sent1']}" for i in picked]
    assert [it["prompt"].split("\n")[0] for it in dev["medmcqa"]] == \
        [f"Question: {MEDMCQA['train'][i]['question']}" for i in picked]
    assert [it["answer"] for it in dev["mbpp"]] == \
        [r["code"].replace("\r\n", "\n") for r in MBPP["prompt"]]
    # humaneval: no dev split, an empty file (no targets), and why
    assert dev["humaneval"] == [] and tasks["humaneval"]["dev"] == 0
    assert "only its test split" in tasks["humaneval"]["dev_why"]

    # the task whose data is missing: not checked, the reason recorded, no files
    assert summary["not_checked"] == [MISSING]
    assert tasks[MISSING]["checked"] is False and tasks[MISSING]["n"] is None
    assert "anatomy" in tasks[MISSING]["error"]
    assert not (out / f"{MISSING}.jsonl").exists() and not val_file(out, MISSING).exists()
    assert all(tasks[t]["checked"] for t in TASKS)
    assert (out / "provenance.json").exists()


def test_targets_are_the_dev_items_in_the_pool_format(docs) -> None:
    """LESS's / RDS+'s targets for the named tasks: the dev items as one-turn records (the
    gold letter or the reference program as the response); humaneval gives none."""
    from clusterft.modeling.prompt import render_prompt
    from clusterft.tasks.targets import available, val_records

    _, out, _ = docs
    dirs = [out.parent / "dataset_items_folder", out]  # the dataset's own folder first
    code = ["humaneval", "mbpp"]
    assert available(dirs, code)
    records, task_of = val_records(dirs, code)
    assert task_of == ["mbpp"] * 3
    first = read_jsonl(val_file(out, "mbpp"))[0]
    assert records[0]["messages"] == [{"role": "user", "content": first["prompt"]},
                                      {"role": "assistant", "content": first["answer"]}]
    assert render_prompt(records[0]["messages"][:1]).endswith(first["prompt"] +
                                                              "\n\n### Response:\n")
    records, task_of = val_records(dirs, ["medqa_4options", "medmcqa"])
    item = read_jsonl(val_file(out, "medqa_4options"))[0]
    assert records[0]["messages"][1]["content"] == "ABCD"[item["label"]]
    assert not available(dirs, ["medqa_4options", MISSING])  # not read: no targets


def test_a_hub_pool_is_checked_against_the_test_documents(docs, offline) -> None:
    """decontaminate on a hub-shaped pool that copies one MedQA test question: flagged and
    dropped like an embedded pool's overlap; the task that could not be read is reported
    as not checked with empty counts, never as 0 overlaps."""
    from clusterft.pools.poolfile import load_pool
    from clusterft.stages.data.decontaminate import run_decontaminate, run_table
    from clusterft.stages.data.prepare import run_prepare_data

    root, out, _ = docs
    spec = yaml.safe_load(PAPER.read_text(encoding="utf-8"))["datasets"]["medflashcards"]
    rows = list(POOLS[spec["hf_dataset"]][2])
    rows += [{"input": f"Explain the finding {words('clean', i)}", "output": f"Answer {i}.",
              "instruction": "Answer this question truthfully"} for i in range(3)]
    leaked = MEDQA["test"][1]
    rows.insert(1, {"input": leaked["sent1"], "output": leaked[f"ending{leaked['label']}"],
                    "instruction": "Answer this question truthfully"})
    write_dataset(root, spec["hf_dataset"], None, {"train": rows}, {"kind": "standin"})
    data = offline / "data"
    run_prepare_data("medflashcards", spec, data / "pool.raw.jsonl", data / "labels.parquet",
                     data / "items", seed=0, mirror=root)  # the hub id, from the mirror
    raw = load_pool(data / "pool.raw.jsonl")
    assert len(raw) == len(rows)
    table = run_decontaminate("medflashcards", data / "pool.raw.jsonl", [data / "items", out],
                              {}, data / "pool.jsonl", data / "contamination.csv")
    kept = load_pool(data / "pool.jsonl")
    assert [r["id"] for r in kept] == [r["id"] for i, r in enumerate(raw) if i != 1]
    csv = pd.read_csv(data / "contamination.csv").set_index("task")
    assert sorted(csv.index) == sorted([*TASKS, MISSING])
    assert csv.loc["medqa_4options", "dropped"] == 1 and csv["remaining"].sum() == 0
    assert csv.loc["medqa_4options", ["exact", "ngram", "similar"]].sum() == 1
    assert csv.loc[TASKS, "checked"].tolist() == [True] * len(TASKS)
    assert csv.loc[[t for t in TASKS if t != "medqa_4options"], "overlapping"].tolist() == \
        [0] * (len(TASKS) - 1)
    # not checked: checked false, every count empty (NA), never 0
    row = csv.loc[MISSING]
    assert row["checked"] == False  # noqa: E712 (numpy bool)
    assert row[["exact", "ngram", "similar", "overlapping", "dropped", "remaining"]].isna().all()
    assert [r["checked"] for r in table] == [t != MISSING for t in sorted([*TASKS, MISSING])]
    # the gathered table keeps the column and the empty counts
    assert run_table([data / "contamination.csv"], offline / "table.csv") == len(TASKS) + 1
    gathered = pd.read_csv(offline / "table.csv").set_index("task")
    assert gathered.loc[MISSING, "checked"] == False  # noqa: E712
    assert pd.isna(gathered.loc[MISSING, "remaining"])


def test_the_dev_split_table_never_names_the_evaluated_split() -> None:
    """DEV_SPLITS against lm-eval's own task YAMLs (read as text, no data): the dev split
    differs from the split lm-eval evaluates (medmcqa's YAML evaluates its validation
    split), and humaneval has none."""
    import lm_eval

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    files = {"humaneval": "humaneval/humaneval.yaml", "mbpp": "mbpp/mbpp.yaml",
             "medqa_4options": "medqa/medqa.yaml", "medmcqa": "medmcqa/medmcqa.yaml",
             "mmlu_college_medicine": "mmlu/default/_default_template_yaml"}
    for task, rel in files.items():
        text = (tasks_dir / rel).read_text(encoding="utf-8")
        test_split = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                          if line.startswith("test_split:"))
        split = lm_eval_docs.dev_split(task).split
        assert split != test_split, task
        if task == "medmcqa":
            assert test_split == "validation" and split == "train"
        if task.startswith("mmlu_"):
            assert "fewshot_split: dev" in text and split == "dev"
    assert not lm_eval_docs.has_dev_split("humaneval")
    assert not lm_eval_docs.has_dev_split("some_other_task")
    assert lm_eval_docs.sample(3, 5, seed=1) == [0, 1, 2]
    assert lm_eval_docs.sample(100, 5, seed=1) == lm_eval_docs.sample(100, 5, seed=1)
