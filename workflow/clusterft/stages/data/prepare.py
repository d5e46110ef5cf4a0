"""The prepare_data stage: build or read a dataset's pool, draw its benchmark items first.

Beside each task's test items (`<items_dir>/<task>.jsonl`) the built-in sources write
`val_per_task` validation items (`<items_dir>/<task>.val.jsonl`, the same item format) for
the target-aware baselines LESS and RDS+ (`clusterft.tasks.targets`): drawn by the same task
generators from a random stream of their own and from held-out inputs only, so the test
items and the pool are byte for byte what they are without them; every validation item
that the decontamination check (exact, 13-gram, near-duplicate; `clusterft.pools.
drop_overlapping`) finds too close to a test item is dropped and counted in the summary
(`val`, `val_dropped`). Nothing that lists `<task>.jsonl` files as tasks may take a
`.val.jsonl` file for one (`clusterft.tasks.registry.is_val_file`).

Pools come from the built-in builders (`clusterft.pools`: skills, pycode, icd10), from a
local JSONL file in the pool schema (`clusterft.pools.poolfile`; ``source: jsonl``), or from a Hugging
Face dataset with a column mapping (``source: hf``; offline unless downloads are allowed, so
a hub id only works from the local cache; ``hf_dataset: json`` with ``data_files`` reads
local files).
"""

from __future__ import annotations

import copy
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from clusterft.tasks.registry import TASKS, check_item, tasks_for_dataset, val_file
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.pace import bars_only_on_terminal
from clusterft.pipeline import provenance
from clusterft.pipeline.io import set_offline_env, write_json, write_jsonl, write_parquet
from clusterft.pools.poolfile import check_unique, load_pool, validate_example, write_pool
from clusterft.pools import OVERLAP_DEFAULTS, POOL_NAMES, drop_overlapping, get_pool_module, val_count
from clusterft.pipeline.sections import check_keys

_CUSTOM: dict[str, dict] = {
    "jsonl": {
        # Pool size cap (null keeps every record).
        "n": None,
        # Local JSONL file in the pool schema.
        "path": None,
        # Optional record field holding the true label (written to labels.parquet).
        "label_field": None,
    },
    "hf": {
        # Pool size cap (null keeps every row).
        "n": None,
        # `datasets.load_dataset` path: a hub id (cached, or with downloads allowed) or a
        # builder such as "json" with data_files.
        "hf_dataset": None,
        # Dataset config name (null for none).
        "hf_config": None,
        # Split to read.
        "split": "train",
        # data_files for builders such as "json" (a path, a list, or a dict).
        "data_files": None,
        # Column mapping: {"messages": col} or {"user": col, "assistant": col} plus optional
        # "input" (appended to the user message), "system", "id", "label".
        "columns": {"user": "instruction", "input": "input", "assistant": "output"},
        # Allow hub downloads (only the paper config does).
        "allow_downloads": False,
    },
}


def _defaults() -> dict[str, dict]:
    out = {}
    for name in POOL_NAMES:
        out[name] = {**copy.deepcopy(get_pool_module(name).DEFAULTS), **OVERLAP_DEFAULTS}
    out.update(copy.deepcopy(_CUSTOM))
    return out


log = logging.getLogger(__name__)

# Per source: its config keys and defaults (each key is commented in the pool modules /
# clusterft.pools.OVERLAP_DEFAULTS / _CUSTOM above).
DEFAULTS: dict[str, dict] = _defaults()
# Keys the workflow config may carry for any dataset; ignored where the source has no use
# for them (e.g. items_per_task / val_per_task for a user's own pool, which has no benchmark
# tasks). val_per_task (validation items per task) is documented in clusterft.pools.skills.
# models and train (which models run on the dataset, its runs' epochs / lr) are the
# workflow's; the data stage ignores them (clusterft.plan.config checks train's keys).
PASSTHROUGH_KEYS = ("domain", "source", "items_per_task", "val_per_task", "models", "train")
# Keys whose value is a mapping of the user's own keys.
FREE_MAPPINGS = ("columns", "data_files")


def merge_cfg(source: str, cfg: Mapping[str, Any] | None, dataset: str | None = None) -> dict:
    """DEFAULTS[source] overridden by cfg; unknown keys raise InputError naming the field."""
    if source not in DEFAULTS:
        raise InputError(f"unknown data source {source!r}; known: {', '.join(DEFAULTS)}",
                         field=f"datasets.{dataset or source}.source")
    cfg = dict(cfg or {})
    allowed = {**DEFAULTS[source], **{k: None for k in PASSTHROUGH_KEYS}}
    check_keys(allowed, cfg, f"datasets.{dataset or source}", free=FREE_MAPPINGS)
    if "val_per_task" in cfg:
        val_count(cfg, f"datasets.{dataset or source}")
    out = copy.deepcopy(DEFAULTS[source])
    out.update({k: v for k, v in cfg.items() if k in out})
    module = get_pool_module(source) if source in POOL_NAMES else None
    if hasattr(module, "check"):  # cross-field rules of a generator, before any work
        module.check({**out, **{k: cfg[k] for k in ("val_per_task",) if k in cfg}},
                     f"datasets.{dataset or source}")
    return out


# ------------------------------------------------------------------------- user data

def load_hf_pool(hf_dataset: str, columns: Mapping[str, str], split: str = "train",
                 hf_config: str | None = None, data_files: Any = None,
                 max_examples: int | None = None, allow_downloads: bool = False,
                 id_prefix: str = "hf") -> tuple[list[dict], list[str] | None]:
    """Load a dataset with `datasets.load_dataset` and map its columns to the pool schema.

    Returns (records, labels or None). Row i is reported as line i + 1 of
    '<hf_dataset>[<split>]' in errors.
    """
    set_offline_env(allow_downloads)
    import datasets

    where = f"{hf_dataset}[{split}]"
    try:
        with bars_only_on_terminal():  # datasets' own bars stay out of the rule's log
            ds = datasets.load_dataset(hf_dataset, hf_config, split=split, data_files=data_files)
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError...)
        raise InputError(f"could not load the dataset ({type(e).__name__}: {e}); offline runs "
                         "need a local path or a cached dataset", path=where,
                         field="hf_dataset") from e
    cols = dict(columns)
    if "messages" not in cols and not {"user", "assistant"} <= set(cols):
        raise InputError("columns must map 'messages', or 'user' and 'assistant'",
                         path=where, field="columns")
    missing = [c for k, c in cols.items() if k != "input" and c not in ds.column_names]
    if missing:
        raise InputError(f"columns {missing} not in the dataset (has {ds.column_names})",
                         path=where, field="columns")
    records, labels, ids = [], [], {}
    for i, row in enumerate(ds):
        if max_examples is not None and len(records) >= max_examples:
            break
        if "messages" in cols:
            msgs = row[cols["messages"]]
        else:
            user = row[cols["user"]]
            extra = row.get(cols["input"]) if "input" in cols else None
            if isinstance(user, str) and isinstance(extra, str) and extra.strip():
                user = f"{user}\n\n{extra}"
            msgs = [{"role": "user", "content": user},
                    {"role": "assistant", "content": row[cols["assistant"]]}]
            if "system" in cols and row.get(cols["system"]):
                msgs.insert(0, {"role": "system", "content": row[cols["system"]]})
        rid = str(row[cols["id"]]) if "id" in cols else f"{id_prefix}-{i:05d}"
        rec = validate_example({"id": rid, "messages": msgs, "source": hf_dataset}, where, i + 1)
        check_unique(ids, rid, where, i + 1)
        records.append(rec)
        if "label" in cols:
            labels.append(str(row[cols["label"]]))
    if not records:
        raise InputError("dataset has no rows", path=where)
    return records, (labels if "label" in cols else None)


def _custom_pool(source: str, cfg: dict, dataset: str) -> tuple[list[dict], list[str]]:
    n = cfg["n"]
    if source == "jsonl":
        if not cfg["path"]:
            raise InputError("a jsonl source needs 'path'", field=f"datasets.{dataset}.path")
        recs = load_pool(cfg["path"], max_examples=n)
        lf = cfg["label_field"]
        labels = [str(r.get(lf, "unlabelled")) if lf else "unlabelled" for r in recs]
        return recs, labels
    if not cfg["hf_dataset"]:
        raise InputError("an hf source needs 'hf_dataset'", field=f"datasets.{dataset}.hf_dataset")
    recs, labels = load_hf_pool(cfg["hf_dataset"], cfg["columns"], cfg["split"],
                                cfg["hf_config"], cfg["data_files"], n,
                                cfg["allow_downloads"], id_prefix=dataset)
    return recs, labels or ["unlabelled"] * len(recs)


# ------------------------------------------------------------------------ the stage

def run_prepare_data(dataset: str, cfg: Mapping[str, Any] | None, out_pool: str | os.PathLike,
                     out_labels: str | os.PathLike, out_items_dir: str | os.PathLike,
                     seed: int = 0, out_summary: str | os.PathLike | None = None,
                     mirror: str | os.PathLike | None = None) -> dict:
    """Stage `prepare_data`: write the pool, its labels and the dataset's benchmark items.

    `dataset` is the config name; `cfg["source"]` (default: the name) picks the builder.
    Writes `out_pool` (JSONL), `out_labels` (parquet: id, label) and
    `<out_items_dir>/<task>.jsonl` for every task of the source, and with `val_per_task` >
    0 (built-in sources) its validation items `<out_items_dir>/<task>.val.jsonl` (see the
    module docstring); returns a summary (also written to `out_summary` if given; `val`:
    validation items written per task, `val_dropped`: per task, those dropped as too close
    to a test item, by reason). `mirror`: the download rule's dataset mirror, where a hub
    id is read from (clusterft.pipeline.mirror), offline.
    """
    import pandas as pd

    cfg = dict(cfg or {})
    source = cfg.get("source", dataset)
    merged = merge_cfg(source, cfg, dataset)
    items: dict[str, list[dict]] = {}
    val: dict[str, list[dict]] = {}
    val_dropped: dict[str, dict[str, int]] = {}
    dropped: dict[str, int] = {}
    extra: dict = {}
    if source in POOL_NAMES:
        built = get_pool_module(source).build(merged, seed)
        records, labels, items = built.records, built.labels, built.items
        dropped, extra = built.dropped, built.extra
        ov = {k: merged.get(k, v) for k, v in OVERLAP_DEFAULTS.items()}
        val, val_dropped = drop_overlapping(built.val_items, items, ov, context=records)
    else:
        from clusterft.pipeline.mirror import has_dataset, resolving_in

        # only a mirrored hub id is read inside the mirror (a local path stays relative to here)
        hub = merged.get("hf_dataset")
        mirrored = bool(hub) and not os.path.exists(hub) and has_dataset(mirror, hub)
        with resolving_in(mirror if mirrored else None):
            records, labels = _custom_pool(source, merged, dataset)
    expected = tasks_for_dataset(source)
    if sorted(items) != sorted(expected):
        raise RuntimeError(f"{source}: built tasks {sorted(items)} != registry {expected}")
    if val and sorted(val) != sorted(expected):
        raise RuntimeError(f"{source}: validation tasks {sorted(val)} != registry {expected}")
    for sets, file_of in ((items, lambda t: Path(out_items_dir) / f"{t}.jsonl"),
                          (val, lambda t: val_file(out_items_dir, t))):
        for task, its in sets.items():
            for j, it in enumerate(its, start=1):
                check_item(it, TASKS[task], str(file_of(task)), j)
    for task, its in val.items():
        asked = val_count(merged)
        if len(its) < asked:
            log.warning("%s: %d of %d validation items (%d dropped as too close to a test "
                        "item)", task, len(its), asked, sum(val_dropped.get(task, {}).values()))
    write_pool(out_pool, records)
    write_parquet(out_labels, pd.DataFrame({"id": [r["id"] for r in records],
                                            "label": [str(x) for x in labels]}))
    Path(out_items_dir).mkdir(parents=True, exist_ok=True)  # empty for a user's own pool
    for task, its in items.items():
        write_jsonl(Path(out_items_dir) / f"{task}.jsonl", its)
    for task, its in val.items():
        write_jsonl(val_file(out_items_dir, task), its)
    summary = {
        "dataset": dataset, "source": source, "seed": seed, "n": len(records),
        "label_counts": dict(sorted(Counter(str(x) for x in labels).items(),
                                    key=lambda kv: (-kv[1], kv[0]))),
        "dropped": dict(sorted(dropped.items())),
        "tasks": {t: len(its) for t, its in items.items()},
        "val": {t: len(its) for t, its in val.items()},
        "val_dropped": val_dropped,
        "extra": extra,
    }
    if out_summary is not None:
        write_json(out_summary, summary)
    provenance.write({"pool": out_pool, "labels": out_labels, "items": out_items_dir},
                     "prepare_data", {}, run_key=f"data[{dataset}]", config=cfg, seed=seed)
    return summary
