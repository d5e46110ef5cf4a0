"""Target-aware selection: the benchmark tasks' validation items as examples, and the
selection rules of LESS (Xia et al. 2024) and RDS+ (Ivison et al. 2025) over them.

Pure functions (numpy; no torch at import). ``score.run_score`` and
``features.run_features`` turn :func:`val_records` into target feature rows beside the
pool's (``targets=``); the rules below then pick pool examples from the two feature sets.

**Validation records** (:func:`val_records`): each task's validation items
(``<items_dir>/<task>.val.jsonl``, written by prepare_data with ``val_per_task`` > 0,
disjoint from the test items under decontaminate's check) as pool-format records, ``id``
(the item's), ``messages`` and ``source`` (``val/<task>``), checked by
``pool.validate_example``. The user message is the item prompt without the
``### Instruction:\\n`` ... ``\\n\\n### Response:\\n`` wrapping (when the prompt has it, as
every built-in item does), so the record renders (``prompt.render_prompt``) to exactly the
prompt the model is evaluated on; the assistant message is what the model should continue
with: the gold choice of a multiple-choice item (choices are exact continuations), or the
gold answer of a generation item with its dataset's response prefix (the stored answer is
stripped; skills responses start with a space, ``pools.skills.RESPONSE_PREFIX``), i.e. the
response a pool example of that task would have.

The named lm-eval tasks (config/paper.yaml) get their validation items from the
``benchmark_docs`` stage: dev items of each task's own dev split, in the same item format
and folder layout (``clusterft.tasks.lm_eval_docs``; ``results/tasks/lm-eval``, the item
folder after the dataset's own). Their prompt is lm-eval's ``doc_to_text`` of the document
(no instruction wrapping, so it is the user message as is) and their gold response the
gold choice (e.g. the letter "B": lm-eval scores it after the prompt's "Answer:") or the
reference answer (mbpp's reference program). So a target record renders in the suite's
prompt format, the format the pool is trained and scored in (as LESS formats its MMLU dev
examples in its training chat format), around the text lm-eval evaluates; lm-eval itself
puts no such wrapping around it, nor MMLU's one-line subject description before it. A task
without a dev split (humaneval) has an empty ``.val.jsonl``: no records (a warning), its
domain's other tasks give the targets.

**LESS** (:func:`less_scores`): a pool example's influence on a validation example is the
learning-rate-weighted sum over warm-up checkpoints of the cosine between their gradient
features; score's rows are built so that the dot product of two rows is exactly that
(``score.combine_checkpoints``). Per task, the mean over its validation examples; then the
max over tasks (LESS's choice, so a task with few validation examples is not outweighed),
or the mean (``agg="mean"``). In LESS's code the training examples' gradients are
Adam-preconditioned (the update direction from the warm-up optimiser's moments) while the
validation examples' are plain SGD gradients (no optimiser state belongs to them). Here
``score.gradient_type: adam`` gives the pool rows the Adam direction and the target rows
the plain gradient, as LESS does; with ``sgd`` both are plain gradients. Both sides use the
same warm-up checkpoints, LoRA adapters, random projection and checkpoint weights.
Selection: :func:`top_k`.

**RDS+** (:func:`rds_round_robin`): representation-based selection on the base model's
hidden states (``features.run_features(kind="embedding")``; RDS+ pools the final layer's
hidden states with a position-weighted mean, our embedding features with the plain mean
over the tokens). Per task, pool examples ranked by the mean cosine to the task's
validation examples; the tasks (sorted by name) take turns, each taking its best example
not taken yet, until ``n`` are taken.

Feature rows must be unit-norm (cosine = dot product), as score and features write them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_jsonl
from clusterft.pools.poolfile import check_unique, validate_example
from clusterft.modeling.prompt import INSTRUCTION, RESPONSE
from clusterft.tasks.registry import TASKS, val_file

log = logging.getLogger(__name__)

#: how less_scores combines the per-task scores
AGGS = ("max", "mean")
#: a feature row's norm may differ from 1 by this much
UNIT_TOL = 1e-3


# --------------------------------------------------------------------- validation records

def response_prefix(task: str) -> str:
    """What the pool responses of the task's dataset start with ('' for a task outside the
    registry or a dataset without a prefix)."""
    spec = TASKS.get(task)
    if spec is None:
        return ""
    from clusterft.pools import POOL_NAMES, get_pool_module

    if spec.dataset not in POOL_NAMES:
        return ""
    return getattr(get_pool_module(spec.dataset), "RESPONSE_PREFIX", "")


def gold_response(item: Mapping[str, Any], task: str) -> str:
    """The continuation a model is trained / scored on for an item: its gold choice, or
    its dataset's response prefix + its gold answer."""
    if "choices" in item:
        return item["choices"][item["label"]]
    return response_prefix(task) + item["answer"]


def user_text(prompt: str) -> str:
    """The item prompt without the instruction/response wrapping of `prompt.render_prompt`
    (when it has it), so that a one-user-message record renders back to `prompt`."""
    if prompt.startswith(INSTRUCTION) and prompt.endswith(RESPONSE) \
            and len(prompt) > len(INSTRUCTION) + len(RESPONSE):
        return prompt[len(INSTRUCTION):-len(RESPONSE)]
    return prompt


def item_record(item: Mapping[str, Any], task: str, where: str = "", line: int | None = None
                ) -> dict:
    """One validation item as a pool-format record (see the module docstring)."""
    if not isinstance(item, Mapping):
        raise InputError("each item must be a JSON object", path=where or task, line=line)
    for key in ("id", "prompt"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise InputError("must be a non-empty string", path=where or task, line=line,
                             field=key)
    try:
        response = gold_response(item, task)
    except (KeyError, IndexError, TypeError) as e:
        raise InputError(f"no gold answer or gold choice ({type(e).__name__}: {e})",
                         path=where or task, line=line, field="answer") from e
    rec = {"id": item["id"],
           "messages": [{"role": "user", "content": user_text(item["prompt"])},
                        {"role": "assistant", "content": response}],
           "source": f"val/{task}"}
    return validate_example(rec, where or task, line)


def _dirs(items_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(items_dir, (str, os.PathLike)):
        return [Path(items_dir)]
    return [Path(d) for d in items_dir]


def val_records(items_dir: str | os.PathLike | Sequence[str | os.PathLike],
                tasks: Sequence[str]) -> tuple[list[dict], list[str]]:
    """The validation items of `tasks` as pool-format records, task by task in the given
    order and each task's items in file order; returns (records, task of each record).

    `items_dir`: a folder (or folders: the first that has a task's file) holding
    `<task>.val.jsonl`. A task without the file is an InputError naming the path; a task
    whose file is empty contributes no record (a warning); no record at all is an error.
    """
    if isinstance(tasks, str) or not tasks:
        raise InputError("give a non-empty list of task names", field="targets.tasks")
    if len(set(tasks)) != len(tasks):
        raise InputError(f"duplicate task names {list(tasks)}", field="targets.tasks")
    dirs = _dirs(items_dir)
    records: list[dict] = []
    task_of: list[str] = []
    ids: dict[str, int] = {}
    for task in tasks:
        path = next((val_file(d, task) for d in dirs if val_file(d, task).exists()), None)
        if path is None:
            raise InputError(f"no validation items for task {task!r}: prepare_data writes "
                             "<task>.val.jsonl with the dataset's val_per_task > 0, "
                             "benchmark_docs for a named lm-eval task it could read",
                             path=str(val_file(dirs[0], task)), field="val_per_task")
        items = read_jsonl(path)
        if not items:
            log.warning("task %s has no validation items (%s)", task, path)
        for line, it in enumerate(items, start=1):
            rec = item_record(it, task, str(path), line)
            check_unique(ids, f"{task}\x00{rec['id']}", str(path), line)
            records.append(rec)
            task_of.append(task)
    if not records:
        raise InputError(f"no validation items for any of the tasks {list(tasks)}",
                         path=str(dirs[0]), field="val_per_task")
    return records, task_of


def available(items_dir: str | os.PathLike | Sequence[str | os.PathLike],
              tasks: Sequence[str]) -> bool:
    """Whether every task has a validation file (prepare_data with val_per_task > 0 and
    repo-defined tasks; benchmark_docs for named lm-eval tasks, an empty one where the task
    has no dev split); users' own pools have none."""
    dirs = _dirs(items_dir)
    return bool(tasks) and all(any(val_file(d, t).exists() for d in dirs) for t in tasks)


def resolve_targets(targets: Any) -> tuple[list[dict], list[str], list[Path]]:
    """A stage's ``targets`` argument as (records, task of each record, item folders to
    check as inputs). Accepted: ``(items_dir, tasks)`` or ``{"items_dir": ..., "tasks":
    [...]}`` (items_dir: a folder or a list of folders; read by :func:`val_records`), or
    ``(records, task_of_record)`` as :func:`val_records` returns them (no folder to check)."""
    if isinstance(targets, Mapping):
        if set(targets) != {"items_dir", "tasks"}:
            raise InputError(f"targets needs exactly the keys items_dir and tasks, got "
                             f"{sorted(targets)}", field="targets")
        first, second = targets["items_dir"], targets["tasks"]
    elif isinstance(targets, (tuple, list)) and len(targets) == 2:
        first, second = targets
    else:
        raise InputError("targets must be (items_dir, tasks), {items_dir, tasks} or "
                         "(records, task_of_record)", field="targets")
    if isinstance(first, (list, tuple)) and first and all(isinstance(r, Mapping) for r in first):
        records = [validate_example(dict(r), "targets", i + 1) for i, r in enumerate(first)]
        task_of = [str(t) for t in second]
        if len(task_of) != len(records):
            raise InputError(f"{len(records)} target records but {len(task_of)} task names",
                             field="targets")
        ids: dict[str, int] = {}
        for i, r in enumerate(records):
            check_unique(ids, f"{task_of[i]}\x00{r['id']}", "targets", i + 1)
        return records, task_of, []
    records, task_of = val_records(first, list(second))
    return records, task_of, _dirs(first)


def check_outputs(targets: Any, out_targets: Any, out_target_ids: Any) -> None:
    """A stage's target arguments go together: targets need both output paths; the two
    paths without targets mean "write them empty" (no validation examples)."""
    if (out_targets is None) != (out_target_ids is None) or (
            targets is not None and out_targets is None):
        raise InputError("targets needs out_targets and out_target_ids (given without "
                         "targets, they are written empty: no validation examples)",
                         field="targets")


def write_outputs(out_targets: str | os.PathLike, out_target_ids: str | os.PathLike,
                  rows: np.ndarray | None, records: Sequence[dict] | None,
                  task_of: Sequence[str], width: int) -> dict[str, str | os.PathLike]:
    """Write the target rows and their (id, task) table; with no targets, a [0, width]
    array and an empty table, so select can say why less/rds cannot run. Returns the
    outputs map for provenance."""
    from clusterft.pipeline.io import save_npy, write_parquet

    save_npy(out_targets, rows if rows is not None else np.zeros((0, width), np.float32))
    write_parquet(out_target_ids, target_table(records or [], task_of))
    return {"targets": out_targets, "target_ids": out_target_ids}


def target_table(records: Sequence[dict], task_of: Sequence[str]):
    """The rows of a target feature file as a DataFrame (id, task), in row order."""
    import pandas as pd

    return pd.DataFrame({"id": [str(r["id"]) for r in records],
                         "task": [str(t) for t in task_of]})


# --------------------------------------------------------------------- selection rules

def _rows(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or not a.shape[0] or not a.shape[1]:
        raise ValueError(f"{name} must be a non-empty [rows, dim] array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has non-finite values")
    norms = np.linalg.norm(a, axis=1)
    bad = np.flatnonzero(np.abs(norms - 1.0) > UNIT_TOL)
    if len(bad):
        raise ValueError(f"{name} rows must be unit-norm (cosine = dot product); rows "
                         f"{bad[:5].tolist()} have norms {norms[bad[:5]].round(4).tolist()}")
    return a


def task_similarity(pool_f: Any, target_f: Any, target_task: Sequence[Any]
                    ) -> tuple[list, np.ndarray]:
    """(tasks in sorted order, [N, T] mean cosine of each pool row with each task's target
    rows). The mean of the cosines is the dot product with the mean target row."""
    p, t = _rows(pool_f, "pool_f"), _rows(target_f, "target_f")
    if p.shape[1] != t.shape[1]:
        raise ValueError(f"pool_f has {p.shape[1]} columns, target_f {t.shape[1]}")
    task = np.asarray(list(target_task), dtype=object)
    if len(task) != len(t):
        raise ValueError(f"{len(t)} target rows but {len(task)} target tasks")
    tasks = sorted(set(task.tolist()))
    means = np.stack([t[task == name].mean(0) for name in tasks])
    return tasks, p @ means.T


def less_scores(pool_f: Any, target_f: Any, target_task: Sequence[Any],
                agg: str = "max") -> np.ndarray:
    """LESS's score of each pool example ([N] float64): per task, the mean over the task's
    validation examples of the cosine with the pool example; then the max over tasks
    (``agg="max"``, LESS's choice) or their mean (``"mean"``). Rows unit-norm."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGGS)}")
    _, sim = task_similarity(pool_f, target_f, target_task)
    return sim.max(1) if agg == "max" else sim.mean(1)


def _ranking(scores: np.ndarray) -> np.ndarray:
    """Indices from the highest score down; ties by the lower index."""
    return np.lexsort((np.arange(len(scores)), -scores))


def _check_n(n: Any, size: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= size:
        raise ValueError(f"n must be an integer in [0, {size}], got {n!r}")
    return int(n)


def top_k(scores: Any, n: int) -> np.ndarray:
    """Indices of the n highest scores (ties: the lower index first), sorted ascending."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.isfinite(s).all():
        raise ValueError("scores must be a 1-d array of finite values")
    n = _check_n(n, len(s))
    return np.sort(_ranking(s)[:n]).astype(np.int64)


def rds_round_robin(pool_f: Any, target_f: Any, target_task: Sequence[Any],
                    n: int) -> np.ndarray:
    """RDS+'s selection of n pool examples, sorted ascending: per task, pool examples
    ranked by the mean cosine to the task's validation examples (ties: lower index); the
    tasks in sorted order take turns, each taking its best example not taken yet."""
    tasks, sim = task_similarity(pool_f, target_f, target_task)
    size = sim.shape[0]
    n = _check_n(n, size)
    ranks = [_ranking(sim[:, j]) for j in range(len(tasks))]
    ptr = [0] * len(tasks)
    taken = np.zeros(size, dtype=bool)
    out: list[int] = []
    while len(out) < n:
        for j, r in enumerate(ranks):
            if len(out) == n:
                break
            p = ptr[j]
            while taken[r[p]]:  # some row is untaken while len(out) < n <= size
                p += 1
            taken[r[p]] = True
            out.append(int(r[p]))
            ptr[j] = p + 1
    return np.sort(np.asarray(out, dtype=np.int64))
