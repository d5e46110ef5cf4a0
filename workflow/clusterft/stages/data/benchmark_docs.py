"""Stage `benchmark_docs`: the named lm-eval tasks' documents as benchmark items.

With `tasks.lm_eval_tasks` (config/paper.yaml) the benchmarks are lm-eval's own tasks, and
prepare_data writes no items for them. This stage reads every named task through lm-eval's
own task definitions (`clusterft.tasks.lm_eval_docs`), from the download rule's hub mirror
(`clusterft.pipeline.mirror.resolving_in`; offline), and writes into one folder
(`OUT_DIR`), in the format prepare_data writes the repo's own tasks in:

- ``<task>.jsonl``: the test documents (the split lm-eval evaluates), which decontaminate
  checks every pool against, with the same checks as the repo's own items;
- ``<task>.val.jsonl``: up to ``val_per_task`` dev items from the task's dev split
  (`lm_eval_docs.DEV_SPLITS`), LESS's and RDS+'s targets (`clusterft.tasks.targets`),
  each dropped if too close to a test document of any named task under the same check
  (`clusterft.pools.drop_overlapping`, as prepare_data drops validation items; the test
  documents give the check its template statistics, as a pool does there). A task with no
  dev split gets an empty file: it has no targets, its domain's other tasks give them;
- ``summary.json``: per task ``checked`` (whether its test documents were read), ``n``
  (test documents), ``dev_split`` and ``dev_why`` (the split, or null, and why), ``dev``
  (dev items written), ``dev_dropped`` (by reason), and ``error`` / ``dev_error`` where
  reading failed.

A task whose test documents cannot be read (not in the mirror, a dataset lm-eval cannot
load, an output type the item format has no place for) does not fail the job: it is
recorded as not checked, with the reason, and logged as a warning; it gets no files, so
decontaminate reports it as not checked (never as 0 overlaps), and without its
``.val.jsonl`` score and features write no targets for its domain's pools (`clusterft.
tasks.targets.available`), so less and rds stop at select there until it is read. The same
for a dev split that cannot be read (``dev_error``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_json, set_offline_env, write_json, write_jsonl
from clusterft.pipeline.mirror import resolving_in
from clusterft.pipeline.pace import bars_only_on_terminal
from clusterft.pools import OVERLAP_DEFAULTS, drop_overlapping
from clusterft.tasks import lm_eval_docs
from clusterft.tasks.registry import val_file

log = logging.getLogger(__name__)

#: the stage's output folder (a dataset name cannot hold a '-', so no prepare_data folder
#: results/tasks/<dataset> is ever this one)
OUT_DIR = "results/tasks/lm-eval"
SUMMARY = "summary.json"


def read_summary(item_dir: str | os.PathLike) -> dict[str, dict]:
    """task -> its summary.json entry, from a folder this stage wrote ({} for any other
    item folder)."""
    path = Path(item_dir) / SUMMARY
    return dict(read_json(path).get("tasks", {})) if path.is_file() else {}


@contextlib.contextmanager
def _code_eval(allowed: bool) -> Iterator[None]:
    """HF_ALLOW_CODE_EVAL=1 for the block when allowed: lm-eval's humaneval and mbpp task
    modules run the code_eval metric on a fixed snippet of their own when imported, and
    refuse without it (the config allows it with evaluate.confirm_run_unsafe_code; no
    model-written code runs here)."""
    old = os.environ.get("HF_ALLOW_CODE_EVAL")
    if allowed:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    try:
        yield
    finally:
        if allowed:
            if old is None:
                os.environ.pop("HF_ALLOW_CODE_EVAL", None)
            else:
                os.environ["HF_ALLOW_CODE_EVAL"] = old


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def read_tasks(tasks: Sequence[str], mirror: str | os.PathLike | None = None,
               val_per_task: int = lm_eval_docs.DEV_ITEMS, seed: int = 0,
               confirm_run_unsafe_code: bool = False
               ) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict[str, dict]]:
    """(task -> test items, task -> dev items, task -> summary entry) of the tasks that
    could be read; the others only in the summary (checked false, error)."""
    from lm_eval.tasks import TaskManager

    test: dict[str, list[dict]] = {}
    dev: dict[str, list[dict]] = {}
    summary: dict[str, dict] = {}
    with resolving_in(mirror), _code_eval(confirm_run_unsafe_code), bars_only_on_terminal():
        tm = TaskManager()
        for name in tasks:
            spec = lm_eval_docs.dev_split(name)
            entry: dict[str, Any] = {"checked": False, "n": None, "dev_split": spec.split,
                                     "dev_why": spec.why, "dev": None, "dev_dropped": {}}
            summary[name] = entry
            try:  # lm-eval and datasets raise many types; each is recorded, not hidden
                task = lm_eval_docs.load_tasks([name], tm)[name]
                test[name] = lm_eval_docs.eval_items(task, name)
            except Exception as e:  # noqa: BLE001
                entry["error"] = _why(e)
                log.warning("lm-eval task %s: test documents not read, so no pool is checked "
                            "against it (%s)", name, entry["error"])
                continue
            entry.update(checked=True, n=len(test[name]))
            try:
                dev[name] = lm_eval_docs.dev_items(task, name, val_per_task, seed)
            except Exception as e:  # noqa: BLE001
                entry["dev_error"] = _why(e)
                log.warning("lm-eval task %s: dev split '%s' not read, so no targets from "
                            "it (%s)", name, spec.split, entry["dev_error"])
    return test, dev, summary


def as_records(items: Mapping[str, Sequence[dict]]) -> list[dict]:
    """Items as pool-format records (the context of the dev items' overlap check)."""
    from clusterft.pools import item_pair

    out = []
    for its in items.values():
        for it in its:
            prompt, answer = item_pair(it)
            out.append({"id": it["id"], "messages": [{"role": "user", "content": prompt},
                                                     {"role": "assistant", "content": answer}]})
    return out


def run_benchmark_docs(tasks: Sequence[str], out_dir: str | os.PathLike,
                       mirror: str | os.PathLike | None = None,
                       val_per_task: int = lm_eval_docs.DEV_ITEMS, seed: int = 0,
                       overlap_cfg: Mapping[str, Any] | None = None,
                       confirm_run_unsafe_code: bool = False,
                       manifest: str | os.PathLike | None = None) -> dict:
    """Write the named tasks' items, dev items and summary.json into `out_dir` (see the
    module docstring); returns the summary. `mirror`: the download rule's hub mirror (None:
    `datasets` resolves hub ids as it would anyway); `manifest`: the download rule's
    manifest, checked as an input; `overlap_cfg`: keys of `clusterft.pools.
    OVERLAP_DEFAULTS` for the dev items' check."""
    if isinstance(tasks, str) or not tasks or len(set(tasks)) != len(tasks):
        raise InputError(f"give a non-empty list of distinct task names, got {tasks!r}",
                         field="tasks.lm_eval_tasks")
    set_offline_env(False)  # jobs read the mirror; only the download rule downloads
    out = Path(out_dir).resolve()  # resolving_in changes the working directory
    checked = provenance.check_inputs({"manifest": manifest} if manifest else {},
                                      "benchmark_docs")
    test, dev, summary = read_tasks(list(tasks), mirror, val_per_task, seed,
                                    confirm_run_unsafe_code)
    ov = {k: (overlap_cfg or {}).get(k, v) for k, v in OVERLAP_DEFAULTS.items()}
    kept, dropped = drop_overlapping(dev, test, ov, context=as_records(test))
    out.mkdir(parents=True, exist_ok=True)
    for name in tasks:
        entry = summary[name]
        if name in test:
            write_jsonl(out / f"{name}.jsonl", test[name])
        if name in kept:
            write_jsonl(val_file(out, name), kept[name])
            entry.update(dev=len(kept[name]), dev_dropped=dropped.get(name, {}))
            asked = len(dev[name])
            if len(kept[name]) < asked:
                log.warning("lm-eval task %s: %d of %d dev items kept (%s dropped as too "
                            "close to a test document)", name, len(kept[name]), asked,
                            sum(dropped.get(name, {}).values()))
        log.info("lm-eval task %s: checked %s, %s test documents, %s dev items (%s)", name,
                 entry["checked"], entry["n"], entry["dev"], entry["dev_split"] or "no dev split")
    doc = {"tasks": summary, "val_per_task": val_per_task, "seed": seed,
           "not_checked": [t for t in tasks if not summary[t]["checked"]]}
    write_json(out / SUMMARY, doc)
    provenance.write({"items": out}, "benchmark_docs", checked,
                     config={"tasks": list(tasks), "val_per_task": val_per_task,
                             "overlap": ov}, seed=seed)
    return doc
