"""Stage `decontaminate`: every pool against every benchmark task's items, before scoring.

`prepare_data` writes `pool.raw.jsonl`; this stage flags each pool example that is too close
to a benchmark item (`clusterft.pools.OverlapIndex`: exact prompt + answer, a shared word
13-gram with content words, or a near-duplicate), against the items of EVERY dataset's
tasks, not only the dataset's own (the built-in builders already avoid their own tasks by
construction, so their own-task counts are 0). Then, by `tasks.decontaminate`:

- ``drop``: remove the flagged examples (re-checked until nothing is flagged: the
  boilerplate statistics depend on the pool itself) and write the rest as `pool.jsonl`;
- ``flag``: keep them, only count them.

It writes one row per benchmark task (`contamination.csv`: counts by reason, dropped,
remaining) and fails, naming the pool, the task and the count, if more than
`tasks.max_overlap` examples overlapping one task remain (default 0). A record counts
under the first benchmark item it matches.

The named lm-eval tasks (config/paper.yaml) come as one more item folder, written by the
`benchmark_docs` stage (`clusterft.stages.data.benchmark_docs`): their test documents as
items, checked exactly as the repo's own. A task that stage could not read is listed in
its summary.json as not checked: its row says ``checked`` false with empty counts (never
0 overlaps: nothing was compared), and a warning names it. Every other row says
``checked`` true.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from clusterft.pipeline.errors import InputError
from clusterft.pipeline import provenance
from clusterft.pipeline.io import read_jsonl, write_text
from clusterft.pools import OVERLAP_DEFAULTS, OverlapIndex, item_pair, record_pair
from clusterft.tasks.registry import is_val_file

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    # drop (remove overlapping pool examples) | flag (keep and count them).
    "action": "drop",
    # Most pool examples overlapping one benchmark task that may remain (0: none).
    "max_overlap": 0,
}
ACTIONS = ("drop", "flag")
REASONS = ("exact", "ngram", "similar")
COLUMNS = ("dataset", "task", "checked", *REASONS, "overlapping", "action", "dropped",
           "remaining", "max_overlap")
#: the counts a not-checked task's row leaves empty (NA)
COUNTS = (*REASONS, "overlapping", "dropped", "remaining")


def load_items(item_dirs: Sequence[str | os.PathLike]) -> dict[str, list[dict]]:
    """task name -> items, from `<dir>/<task>.jsonl` of every benchmark folder (the test
    items; validation items, `<task>.val.jsonl`, are not a task: prepare_data already
    dropped those too close to a test item, and pool examples may resemble them)."""
    items: dict[str, list[dict]] = {}
    for d in item_dirs:
        for f in sorted(Path(d).glob("*.jsonl")) if Path(d).is_dir() else ():
            if not is_val_file(f):
                items[f.stem] = read_jsonl(f)
    return items


def not_checked(item_dirs: Sequence[str | os.PathLike]) -> dict[str, str]:
    """task -> why, for every task an item folder's summary.json (the benchmark_docs
    stage's) lists as not checked: its test documents could not be read."""
    from clusterft.stages.data.benchmark_docs import read_summary

    out: dict[str, str] = {}
    for d in item_dirs:
        for task, entry in read_summary(d).items():
            if not entry.get("checked", False):
                out[task] = str(entry.get("error") or "not read")
    return out


def overlaps(records: Sequence[dict], items: Mapping[str, Sequence[dict]],
             overlap_cfg: Mapping[str, Any] | None = None) -> list[tuple[str, str] | None]:
    """Per pool record: None, or (task, reason) of the first benchmark item it overlaps."""
    tasks, pairs = [], []
    for task, its in items.items():
        for it in its:
            tasks.append(task)
            pairs.append(item_pair(it))
    if not pairs or not records:
        return [None] * len(records)
    index = OverlapIndex.from_cfg(pairs, dict(overlap_cfg or {}))
    out: list[tuple[str, str] | None] = []
    for f in index.flag([record_pair(r) for r in records]):
        if f is None:
            out.append(None)
        else:
            reason, i = f.split(":")
            out.append((tasks[int(i)], reason))
    return out


def decontaminate(records: list[dict], items: Mapping[str, Sequence[dict]], action: str = "drop",
                  overlap_cfg: Mapping[str, Any] | None = None
                  ) -> tuple[list[dict], dict[str, Counter], list[tuple[int, str, str]]]:
    """Returns (kept records, task -> Counter of reasons/'dropped'/'remaining', and
    (record index, task, reason) of every overlapping record found)."""
    if action not in ACTIONS:
        raise InputError(f"unknown action '{action}'; valid: {', '.join(ACTIONS)}",
                         field="tasks.decontaminate")
    counts: dict[str, Counter] = {t: Counter() for t in items}
    found: list[tuple[int, str, str]] = []
    alive = list(range(len(records)))
    for _ in range(20):
        flags = overlaps([records[i] for i in alive], items, overlap_cfg)
        hits = [(i, f) for i, f in zip(alive, flags) if f is not None]
        for i, (task, reason) in hits:
            counts[task][reason] += 1
            found.append((i, task, reason))
        if action == "flag":
            for _, (task, _r) in hits:
                counts[task]["remaining"] += 1
            break
        for _, (task, _r) in hits:
            counts[task]["dropped"] += 1
        gone = {i for i, _ in hits}
        alive = [i for i in alive if i not in gone]
        if not hits:
            break
    else:
        raise RuntimeError("the pool did not settle under the overlap check")
    return [records[i] for i in alive], counts, found


def table_rows(dataset: str, counts: Mapping[str, Counter], action: str,
               max_overlap: int, unchecked: Sequence[str] = ()) -> list[dict]:
    """One row per task, sorted by task: the counts of each checked task; `unchecked`
    tasks with ``checked`` false and empty counts."""
    rows = []
    for task in sorted(set(counts) | set(unchecked)):
        if task in counts:
            c = counts[task]
            rows.append({"dataset": dataset, "task": task, "checked": True,
                         **{r: c[r] for r in REASONS},
                         "overlapping": sum(c[r] for r in REASONS), "action": action,
                         "dropped": c["dropped"], "remaining": c["remaining"],
                         "max_overlap": max_overlap})
        else:
            rows.append({"dataset": dataset, "task": task, "checked": False,
                         **{k: None for k in COUNTS}, "action": action,
                         "max_overlap": max_overlap})
    return rows


def write_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> None:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for row in rows:  # true/false as the CSV readers (pandas) parse them; None as empty
        w.writerow({k: str(v).lower() if isinstance(v, bool) else v for k, v in row.items()})
    write_text(path, buf.getvalue())


def run_decontaminate(dataset: str, raw_pool: str | os.PathLike,
                      item_dirs: Sequence[str | os.PathLike], cfg: Mapping[str, Any] | None,
                      out_pool: str | os.PathLike, out_counts: str | os.PathLike) -> list[dict]:
    """Check (and by config clean) one pool against every benchmark; returns the table rows.

    `cfg`: `action`, `max_overlap` (DEFAULTS) and the overlap-check keys of
    `clusterft.pools.OVERLAP_DEFAULTS` (the dataset's own, if it sets them).
    """
    from clusterft.pools.poolfile import load_pool, write_pool

    cfg = dict(cfg or {})
    unknown = set(cfg) - set(DEFAULTS) - set(OVERLAP_DEFAULTS)
    if unknown:
        raise InputError(f"unknown keys {sorted(unknown)}", field="tasks")
    action = cfg.get("action", DEFAULTS["action"])
    max_overlap = int(cfg.get("max_overlap", DEFAULTS["max_overlap"]))
    ov = {k: cfg.get(k, v) for k, v in OVERLAP_DEFAULTS.items()}
    checked = provenance.check_inputs(
        {"pool": raw_pool, "items": [d for d in item_dirs if Path(d).is_dir()]}, "decontaminate")
    records = load_pool(raw_pool)
    items = load_items(item_dirs)
    unchecked = {t: why for t, why in not_checked(item_dirs).items() if t not in items}
    for task, why in sorted(unchecked.items()):
        log.warning("pool '%s' is NOT checked against benchmark task '%s': its test documents "
                    "were not read (%s)", dataset, task, why)
    kept, counts, found = decontaminate(records, items, action, ov)
    rows = table_rows(dataset, counts, action, max_overlap, sorted(unchecked))
    first: dict[str, tuple[int, str]] = {}
    for i, task, reason in found:
        first.setdefault(task, (i, reason))
    over = [r for r in rows if r["checked"] and r["remaining"] > max_overlap]
    if over:
        worst = max(over, key=lambda r: r["remaining"])
        i, reason = first[worst["task"]]
        others = "; ".join(f"{r['task']}: {r['remaining']}" for r in over if r is not worst)
        raise InputError(
            f"pool '{dataset}' still has {worst['remaining']} examples overlapping benchmark task "
            f"'{worst['task']}' ({worst['exact']} exact, {worst['ngram']} 13-gram, "
            f"{worst['similar']} near-duplicate; first: record {records[i]['id']!r}, {reason}), "
            f"more than tasks.max_overlap = {max_overlap} with tasks.decontaminate = "
            f"{action}" + (f" (also {others})" if others else "")
            + "; set tasks.decontaminate: drop, or clean the pool",
            path=str(raw_pool), line=i + 1, field="tasks.max_overlap")
    if not kept:
        raise InputError(f"pool '{dataset}' is empty after decontamination: all {len(records)} "
                         f"records (lines 1-{len(records)}) overlap benchmark items and were "
                         "dropped", path=str(raw_pool), field="tasks.decontaminate")
    write_pool(out_pool, kept)
    write_csv(out_counts, rows)
    provenance.write({"pool": out_pool, "counts": out_counts}, "decontaminate", checked,
                     inherit=("pool",), config=cfg)
    return rows


def run_table(counts: Sequence[str | os.PathLike], out_csv: str | os.PathLike) -> int:
    """Gather the per-pool tables into one (results/tables/contamination.csv); returns rows."""
    import csv

    rows: list[dict] = []
    for p in counts:
        with open(p, encoding="utf-8", newline="") as f:
            rows.extend(csv.DictReader(f))
    write_csv(out_csv, rows)
    return len(rows)
