"""Instruction pools on disk: loading with validation, writing, and the prepare_data stage.

Pool schema (one JSON object per line): ``{"id": str, "messages": [{"role":
"user"|"assistant"|"system", "content": str}, ...], "source": str}`` with at least one user
message, exactly one assistant message and it last, a system message only first, non-empty
contents, unique ids. Every error names the file, the line and the field.

Pools come from the built-in builders (`clusterft.pools`: skills, pycode, icd10), from a
local JSONL file in the schema (``source: jsonl``), or from a Hugging Face dataset with a
column mapping (``source: hf``; offline unless downloads are allowed, so a hub id only
works from the local cache; ``hf_dataset: json`` with ``data_files`` reads local files).
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

from .benchmarks import TASKS, check_item, tasks_for_dataset
from .errors import InputError
from .io import set_offline_env, write_json, write_jsonl, write_parquet
from .pools import OVERLAP_DEFAULTS, POOL_NAMES, get_pool_module

ROLES = ("system", "user", "assistant")

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


# Per source: its config keys and defaults (each key is commented in the pool modules /
# clusterft.pools.OVERLAP_DEFAULTS / _CUSTOM above).
DEFAULTS: dict[str, dict] = _defaults()
# Keys the workflow config may carry for any dataset; ignored where the source has no use
# for them (e.g. items_per_task for a user's own pool, which has no benchmark tasks).
PASSTHROUGH_KEYS = ("domain", "source", "items_per_task")


def merge_cfg(source: str, cfg: Mapping[str, Any] | None, dataset: str | None = None) -> dict:
    """DEFAULTS[source] overridden by cfg; unknown keys raise InputError naming the field."""
    if source not in DEFAULTS:
        raise InputError(f"unknown data source {source!r}; known: {', '.join(DEFAULTS)}",
                         field=f"datasets.{dataset or source}.source")
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(DEFAULTS[source]) - set(PASSTHROUGH_KEYS))
    if unknown:
        raise InputError(f"unknown keys {unknown} for source {source!r}; known: "
                         f"{sorted(DEFAULTS[source])}", field=f"datasets.{dataset or source}")
    out = copy.deepcopy(DEFAULTS[source])
    out.update({k: v for k, v in cfg.items() if k in out})
    return out


# ---------------------------------------------------------------------------- validation

def validate_example(rec: Any, path: str | os.PathLike, line: int | None) -> dict:
    """Check one record against the pool schema; return it with `source` filled in.

    Raises InputError naming the file, the line and the field.
    """
    path = str(path)

    def bad(field: str, what: str) -> InputError:
        return InputError(what, path=path, line=line, field=field)

    if not isinstance(rec, dict):
        raise bad("(record)", "each record must be a JSON object")
    rid = rec.get("id")
    if "id" not in rec:
        raise bad("id", "missing; every example needs a unique string id")
    if not isinstance(rid, str) or not rid.strip():
        raise bad("id", f"must be a non-empty string, got {rid!r}")
    msgs = rec.get("messages")
    if "messages" not in rec:
        raise bad("messages", "missing; expected a list of {role, content} messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role is None:
            raise bad(f"messages[{i}].role", "missing role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"unknown role {role!r}; use one of {ROLES}")
        content = m.get("content")
        if content is None:
            raise bad(f"messages[{i}].content", "missing content")
        if not isinstance(content, str) or not content.strip():
            raise bad(f"messages[{i}].content", "must be a non-empty string")
        if role == "system" and i != 0:
            raise bad(f"messages[{i}].role", "a system message may only come first")
    roles = [m["role"] for m in msgs]
    if roles[-1] != "assistant":
        raise bad(f"messages[{len(msgs) - 1}].role",
                  "the last message must be the assistant's response")
    if roles.count("assistant") != 1:
        raise bad("messages", "exactly one assistant message (the last) is allowed")
    if "user" not in roles:
        raise bad("messages", "at least one user message is required")
    src = rec.get("source", Path(path).stem)
    if not isinstance(src, str):
        raise bad("source", f"must be a string, got {src!r}")
    out = dict(rec)
    out["source"] = src
    return out


def _check_unique(ids: dict[str, int], rid: str, path: str, line: int) -> None:
    if rid in ids:
        raise InputError(f"duplicate id {rid!r} (first seen on line {ids[rid]})", path=path,
                         line=line, field="id")
    ids[rid] = line


def _non_utf8_field(raw: bytes) -> str:
    """The field holding the first bytes that are not UTF-8 ('(record)' if not found)."""
    try:
        rec = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except ValueError:
        return "(record)"

    def bad(text: str) -> bool:
        return any("\udc80" <= ch <= "\udcff" for ch in text)

    def find(obj: Any, where: str) -> str | None:
        if isinstance(obj, str):
            return where if bad(obj) else None
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            sub = f"{where}[{k}]" if isinstance(k, int) else (f"{where}.{k}" if where else str(k))
            hit = sub if isinstance(k, str) and bad(k) else find(v, sub)
            if hit:
                return hit
        return None

    return find(rec, "") or "(record)"


def load_pool(path: str | os.PathLike, max_examples: int | None = None) -> list[dict]:
    """Read and validate a pool JSONL file (the first `max_examples` records if given)."""
    p = Path(path)
    if not p.exists():
        raise InputError("pool file does not exist; check the path in the config", path=str(p))
    out: list[dict] = []
    ids: dict[str, int] = {}
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if max_examples is not None and len(out) >= max_examples:
                break
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"not valid UTF-8 ({e.reason} at byte {e.start} of the line); "
                                 "save the file as UTF-8", path=str(p), line=lineno,
                                 field=_non_utf8_field(raw)) from e
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise InputError(f"malformed JSON: {e.msg} (character {e.pos + 1} of the line); "
                                 "each line must be one complete JSON object", path=str(p),
                                 line=lineno,
                                 field="(record)") from e
            rec = validate_example(rec, p, lineno)
            _check_unique(ids, rec["id"], str(p), lineno)
            out.append(rec)
    if not out:
        raise InputError("pool is empty: no examples found (blank lines only)", path=str(p),
                         field="(record)")
    return out


def write_pool(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Validate records (record number = line) and write them as JSONL; returns the count."""
    recs = list(records)
    ids: dict[str, int] = {}
    for i, r in enumerate(recs, start=1):
        validate_example(r, path, i)
        _check_unique(ids, r["id"], str(path), i)
    if not recs:
        raise InputError("refusing to write an empty pool", path=str(path))
    write_jsonl(path, recs)
    return len(recs)


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
        _check_unique(ids, rid, where, i + 1)
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
                     out_labels: str | os.PathLike, out_bench_dir: str | os.PathLike,
                     seed: int = 0, out_summary: str | os.PathLike | None = None) -> dict:
    """Stage `prepare_data`: write the pool, its labels and the dataset's benchmark items.

    `dataset` is the config name; `cfg["source"]` (default: the name) picks the builder.
    Writes `out_pool` (JSONL), `out_labels` (parquet: id, label) and
    `<out_bench_dir>/<task>.jsonl` for every task of the source; returns a summary (also
    written to `out_summary` if given).
    """
    import pandas as pd

    cfg = dict(cfg or {})
    source = cfg.get("source", dataset)
    merged = merge_cfg(source, cfg, dataset)
    items: dict[str, list[dict]] = {}
    dropped: dict[str, int] = {}
    extra: dict = {}
    if source in POOL_NAMES:
        built = get_pool_module(source).build(merged, seed)
        records, labels, items = built.records, built.labels, built.items
        dropped, extra = built.dropped, built.extra
    else:
        records, labels = _custom_pool(source, merged, dataset)
    expected = tasks_for_dataset(source)
    if sorted(items) != sorted(expected):
        raise RuntimeError(f"{source}: built tasks {sorted(items)} != registry {expected}")
    for task, its in items.items():
        where = str(Path(out_bench_dir) / f"{task}.jsonl")
        for j, it in enumerate(its, start=1):
            check_item(it, TASKS[task], where, j)
    write_pool(out_pool, records)
    write_parquet(out_labels, pd.DataFrame({"id": [r["id"] for r in records],
                                            "label": [str(x) for x in labels]}))
    Path(out_bench_dir).mkdir(parents=True, exist_ok=True)  # empty for a user's own pool
    for task, its in items.items():
        write_jsonl(Path(out_bench_dir) / f"{task}.jsonl", its)
    summary = {
        "dataset": dataset, "source": source, "seed": seed, "n": len(records),
        "label_counts": dict(sorted(Counter(str(x) for x in labels).items(),
                                    key=lambda kv: (-kv[1], kv[0]))),
        "dropped": dict(sorted(dropped.items())),
        "tasks": {t: len(its) for t, its in items.items()},
        "extra": extra,
    }
    if out_summary is not None:
        write_json(out_summary, summary)
    return summary
