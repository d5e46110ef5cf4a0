"""lm-eval's built-in tasks (config/paper.yaml's `tasks.lm_eval_tasks`) as benchmark items.

The repo-defined tasks write their items themselves (prepare_data); lm-eval's named tasks
are read here, through lm-eval's own task definitions (its TaskManager, its YAMLs' dataset
ids, splits and prompt functions), and turned into the same item format, so that the
decontamination check (`clusterft.stages.data.decontaminate`) and the target-aware
baselines (`clusterft.tasks.targets`) treat them like the repo's own:

- multiple choice: ``{"id", "prompt", "choices", "label"}``: ``prompt`` is the task's
  ``doc_to_text(doc)``, ``choices`` its ``doc_to_choice(doc)`` (e.g. the letters A-D of
  MMLU, MedQA, MedMCQA: the continuations lm-eval scores), ``label`` the index of
  ``doc_to_target(doc)`` among them;
- generation: ``{"id", "prompt", "answer"}``: ``answer`` is the reference answer. For the
  code tasks that is the reference program (:data:`GOLD_FIELDS`: humaneval's
  ``canonical_solution``, mbpp's ``code``), not ``doc_to_target``, which there gives the
  unit tests that run the model's program (a pool example that leaks a benchmark problem
  holds its solution, not its tests; and a target example's response is what the model
  should write). Windows line ends (mbpp's ``code``) become ``\\n``; the answer is
  otherwise kept as written (humaneval's solution starts with the body's indentation).

Left out of the prompt: the task's ``description`` (MMLU's "The following are multiple
choice questions (with answers) about <subject>." line, the same for every item of a
subject) and few-shot examples, which lm-eval puts before the document: the items are the
documents themselves, which keeps the overlap checks on what differs between documents.

**Test documents** (:func:`eval_items`): the split lm-eval evaluates (``task.eval_docs``:
``test_split``, else ``validation_split``; medmcqa's YAML names its validation split as
its test split, its test split having no answers).

**Dev items** (:func:`dev_items`): LESS (Xia et al. 2024) takes its targets from a
benchmark's own few-shot / dev examples (MMLU's 5 dev examples per subject); here each
task's dev split is named in :data:`DEV_SPLITS` (with the reason), never the split lm-eval
evaluates. Up to ``n`` of them (:data:`DEV_ITEMS` by default): all, in split order, where
the split has at most ``n``; else the first ``n`` after a seeded shuffle. A task with no
dev split (humaneval: it has only its test split) has none; its domain's other tasks
give the targets. Only tasks listed in DEV_SPLITS have dev items (the config check reads
the table without loading lm-eval).

lm_eval is imported inside the functions only (this module is imported by the config
check).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from clusterft.pipeline.errors import InputError

#: dev items per task by default: MMLU's dev split holds 5 per subject (LESS's targets)
DEV_ITEMS = 5


@dataclass(frozen=True)
class DevSplit:
    """Where a task's dev items come from: a split of its dataset (None: there is none)."""

    split: str | None
    why: str


#: MMLU's 57 subjects (lm-eval's `mmlu_<subject>` tasks of the default MMLU group)
MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology "
    "college_chemistry college_computer_science college_mathematics college_medicine "
    "college_physics computer_security conceptual_physics econometrics electrical_engineering "
    "elementary_mathematics formal_logic global_facts high_school_biology "
    "high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics "
    "high_school_mathematics high_school_microeconomics high_school_physics "
    "high_school_psychology high_school_statistics high_school_us_history "
    "high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous "
    "moral_disputes moral_scenarios nutrition philosophy prehistory professional_accounting "
    "professional_law professional_medicine professional_psychology public_relations "
    "security_studies sociology us_foreign_policy virology world_religions").split()

_MMLU_DEV = DevSplit("dev", "MMLU's dev split: the 5 few-shot examples per subject that "
                            "lm-eval's fewshot_split names (LESS's MMLU targets)")

#: lm-eval task -> its dev split (checked against each task's YAML in lm-eval 0.4.13)
DEV_SPLITS: dict[str, DevSplit] = {
    "humaneval": DevSplit(None, "openai_humaneval has only its test split (164 problems, "
                                "all evaluated)"),
    "mbpp": DevSplit("prompt", "mbpp's few-shot split (task_ids 1-10; lm-eval's 3 shots are "
                               "task_ids 2-4 of it); lm-eval evaluates the test split"),
    "medqa_4options": DevSplit("validation", "lm-eval evaluates the test split; validation "
                                             "is the benchmark's own dev split"),
    "medmcqa": DevSplit("train", "lm-eval evaluates the validation split (the test split "
                                 "has no answers), so the dev items are a seeded sample of "
                                 "the train split"),
    **{f"mmlu_{s}": _MMLU_DEV for s in MMLU_SUBJECTS},
}

#: generation tasks whose reference answer is a document field (see the module docstring)
GOLD_FIELDS: dict[str, str] = {"humaneval": "canonical_solution", "mbpp": "code"}

OUTPUT_TYPES = ("multiple_choice", "generate_until")


def dev_split(task: str) -> DevSplit:
    """The task's dev split (:data:`DEV_SPLITS`); a task not in the table has none."""
    return DEV_SPLITS.get(task) or DevSplit(
        None, "no dev split is known for this task (clusterft.tasks.lm_eval_docs.DEV_SPLITS)")


def has_dev_split(task: str) -> bool:
    return dev_split(task).split is not None


def load_tasks(names: Sequence[str], task_manager: Any = None) -> dict[str, Any]:
    """lm-eval Task objects by name, each built by lm-eval's own TaskManager (which reads
    its dataset with `datasets.load_dataset`: run inside `mirror.resolving_in`). One task
    that cannot be built raises; load them one by one to tell which."""
    from lm_eval.tasks import TaskManager

    tm = task_manager or TaskManager()
    tasks = tm.load(list(names))["tasks"]
    missing = [n for n in names if n not in tasks]
    if missing:
        raise InputError(f"lm-eval built no task named {missing} (a group or tag?)",
                         field="tasks.lm_eval_tasks")
    return {n: tasks[n] for n in names}


def _docs(task: Any, split: str) -> Any:
    """The documents of one split of the task's dataset (a `datasets.Dataset` or a list:
    len and indexing), through the task's own process_docs when it has one (as lm-eval
    reads its test and few-shot docs)."""
    if split not in task.dataset:
        raise InputError(f"the dataset has no split '{split}' (has {sorted(task.dataset)})",
                         field="split")
    docs = task.dataset[split]
    process = getattr(task.config, "process_docs", None)
    return process(docs) if callable(process) else docs


def doc_item(task: Any, name: str, doc: Mapping[str, Any], item_id: str) -> dict:
    """One lm-eval document as an item (see the module docstring)."""
    where = f"lm-eval task {name}"
    prompt = task.doc_to_text(doc)
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"doc_to_text gave {type(prompt).__name__} {prompt!r}, not a "
                         "non-empty string", path=where, field="prompt")
    otype = task.config.output_type
    if otype == "multiple_choice":
        choices = [str(c) for c in task.doc_to_choice(doc)]
        target = task.doc_to_target(doc)
        if isinstance(target, list):  # several gold targets: the first
            target = target[0]
        label = target if isinstance(target, int) and not isinstance(target, bool) \
            else choices.index(str(target)) if str(target) in choices else None
        if len(choices) < 2 or label is None or not 0 <= label < len(choices):
            raise InputError(f"doc_to_target {target!r} is not one of the choices {choices}",
                             path=where, field="label")
        return {"id": item_id, "prompt": prompt, "choices": choices, "label": int(label)}
    if otype == "generate_until":
        field = GOLD_FIELDS.get(name)
        answer = doc[field] if field else task.doc_to_target(doc)
        if isinstance(answer, list):
            answer = answer[0] if answer else ""
        answer = str(answer).replace("\r\n", "\n")
        if not answer.strip():
            raise InputError("empty reference answer", path=where,
                             field=field or "doc_to_target")
        return {"id": item_id, "prompt": prompt, "answer": answer}
    raise InputError(f"output_type {otype!r} is not supported (only {', '.join(OUTPUT_TYPES)})",
                     path=where, field="output_type")


def eval_items(task: Any, name: str) -> list[dict]:
    """The documents lm-eval evaluates the task on, as items ``<name>-00000``, ... (in
    document order)."""
    docs = list(task.eval_docs)
    if not docs:
        raise InputError("the split lm-eval evaluates has no documents",
                         path=f"lm-eval task {name}")
    return [doc_item(task, name, d, f"{name}-{i:05d}") for i, d in enumerate(docs)]


def sample(n_docs: int, n: int, seed: int) -> list[int]:
    """Indices of the dev documents taken: all where there are at most n, else the first n
    of a seeded shuffle (fixed for a seed and a split size)."""
    if n_docs <= n:
        return list(range(n_docs))
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    return order[:n]


def dev_items(task: Any, name: str, n: int = DEV_ITEMS, seed: int = 0) -> list[dict]:
    """Up to n dev items of the task from its :data:`DEV_SPLITS` split, ids
    ``<name>-dev-0000``, ... ([] where the task has no dev split)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"must be an integer >= 0, got {n!r}", field="val_per_task")
    spec = dev_split(name)
    if spec.split is None or n == 0:
        return []
    if spec.split == getattr(task.config, "test_split", None) or (
            getattr(task.config, "test_split", None) is None
            and spec.split == getattr(task.config, "validation_split", None)):
        raise InputError(f"dev split '{spec.split}' is the split lm-eval evaluates",
                         path=f"lm-eval task {name}", field="split")
    docs = _docs(task, spec.split)
    return [doc_item(task, name, docs[int(i)], f"{name}-dev-{j:04d}")
            for j, i in enumerate(sample(len(docs), n, seed))]
