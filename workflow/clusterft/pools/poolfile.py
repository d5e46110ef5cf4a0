"""The instruction pool on disk and subsets of it: read and check a pool file, write one,
read a selection and restrict a pool to it. Every stage that reads a pool reads it here.

Pool schema (one JSON object per line): ``{"id": str, "messages": [{"role":
"user"|"assistant"|"system", "content": str}, ...], "source": str}`` with at least one user
message, exactly one assistant message and it last, a system message only first, non-empty
contents, unique ids. Every error names the file, the line and the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import text_lines, write_jsonl

ROLES = ("system", "user", "assistant")


# ---------------------------------------------------------------------------- pools

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


def check_unique(ids: dict[str, int], rid: str, path: str, line: int) -> None:
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
        for lineno, raw in text_lines(f):
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
            check_unique(ids, rec["id"], str(p), lineno)
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
        check_unique(ids, r["id"], str(path), i)
    if not recs:
        raise InputError("refusing to write an empty pool", path=str(path))
    write_jsonl(path, recs)
    return len(recs)


# ---------------------------------------------------------------------------- selections

# The optional column of a selection that assigns each row to an epoch's subset.
EPOCH = "epoch"


def read_selection(path: str | os.PathLike):
    """Read selection.parquet (columns id, cluster, score; optionally epoch).

    Without an ``epoch`` column the selection is one subset, trained on every epoch: each id
    at most once. With one (RS2-style repeated sampling, method ``rs2``) the rows with
    ``epoch == e`` are epoch e's subset: the epochs are the integers 0..E-1 with none
    missing, every epoch has the same number of rows, an id appears at most once per epoch
    (it may recur in other epochs) and keeps one cluster throughout. Every violation is an
    InputError naming the file and the field.
    """
    import pandas as pd

    p = Path(path)
    if not p.exists():
        raise InputError("selection file does not exist", path=str(p))
    try:
        df = pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises many types
        raise InputError(f"cannot read parquet: {e}", path=str(p)) from e
    for col in ("id", "cluster"):
        if col not in df.columns:
            raise InputError(f"missing column '{col}' (need id, cluster, score)", path=str(p), field=col)
    if EPOCH in df.columns:
        _check_epochs(df, str(p))
    elif df["id"].duplicated().any():
        dup = df["id"][df["id"].duplicated()].iloc[0]
        raise InputError(f"duplicate id '{dup}'", path=str(p), field="id")
    if len(df) == 0:
        raise InputError("selection is empty", path=str(p))
    return df


def _check_epochs(df, path: str) -> None:
    """Validate a selection's ``epoch`` column (see :func:`read_selection`)."""
    import pandas as pd

    def bad(what: str, field: str = EPOCH) -> InputError:
        return InputError(what, path=path, field=field)

    ep = df[EPOCH]
    if not pd.api.types.is_integer_dtype(ep.dtype) or pd.api.types.is_bool_dtype(ep.dtype):
        raise bad(f"must hold integers (the epoch whose subset each row belongs to), got dtype "
                  f"{ep.dtype}")
    if ep.isna().any():
        raise bad(f"missing value in row {int(np.flatnonzero(ep.isna().to_numpy())[0])}; every "
                  "row needs its epoch")
    if len(df) == 0:
        return
    e = ep.to_numpy(dtype=np.int64)
    if (e < 0).any():
        row = int(np.flatnonzero(e < 0)[0])
        raise bad(f"must be >= 0, got {int(e[row])} in row {row}")
    epochs, sizes = np.unique(e, return_counts=True)
    gap = np.flatnonzero(epochs != np.arange(len(epochs)))
    if len(gap):
        missing = int(gap[0])
        raise bad(f"epochs must be numbered 0..E-1 with none missing: no rows for epoch "
                  f"{missing} (epochs present: {_brief(epochs)})")
    if (sizes != sizes[0]).any():
        j = int(np.flatnonzero(sizes != sizes[0])[0])
        raise bad(f"every epoch's subset must have the same size: epoch 0 has {int(sizes[0])} "
                  f"rows, epoch {j} has {int(sizes[j])}")
    dup = df.duplicated(["id", EPOCH])
    if dup.any():
        row = int(np.flatnonzero(dup.to_numpy())[0])
        raise bad(f"id '{df['id'].iloc[row]}' appears twice in epoch {int(e[row])} (row {row}); "
                  "an epoch's subset holds each id at most once")
    per_id = df.groupby("id", sort=False)["cluster"].nunique()
    if (per_id > 1).any():
        rid = per_id.index[int(np.flatnonzero(per_id.to_numpy() > 1)[0])]
        raise bad(f"id '{rid}' has different clusters in different epochs; an id keeps one "
                  "cluster", field="cluster")


def _brief(values: np.ndarray, k: int = 8) -> str:
    shown = ", ".join(str(int(v)) for v in values[:k])
    return shown + (f", ... ({len(values)} in all)" if len(values) > k else "")


def select_records(pool: list[dict], selection, pool_path: str = "pool",
                   selection_path: str = "selection") -> tuple[list[dict], np.ndarray, list[int]]:
    """Restrict a loaded pool to the selection ids, in pool order.

    Returns (records, their cluster ids, their 1-based pool lines); an id the pool lacks is
    an error naming the selection file and the row. A selection with epochs gives every
    distinct id once (the union of the epochs' subsets); :func:`epoch_subsets` says which
    of these records each epoch holds.
    """
    by_id = {rec["id"]: i for i, rec in enumerate(pool)}
    cluster_of = dict(zip(selection["id"].astype(str), selection["cluster"].astype(int)))
    for row, sid in enumerate(selection["id"].astype(str)):
        if sid not in by_id:
            raise InputError(f"id '{sid}' (row {row}) is not in the pool {pool_path}",
                             path=selection_path, field="id")
    idx = sorted(by_id[s] for s in cluster_of)
    records = [pool[i] for i in idx]
    clusters = np.asarray([cluster_of[r["id"]] for r in records], dtype=np.int64)
    return records, clusters, [i + 1 for i in idx]


def selection_epochs(selection) -> int | None:
    """How many epoch subsets a selection holds (E), or None for one subset for every epoch."""
    if EPOCH not in selection.columns:
        return None
    return int(selection[EPOCH].max()) + 1


def epoch_subsets(selection, records: list[dict]) -> list[np.ndarray] | None:
    """Each epoch's subset as ascending indices into ``records`` (those of
    :func:`select_records`, so in pool order), epochs 0..E-1; None without an epoch column."""
    n_epochs = selection_epochs(selection)
    if n_epochs is None:
        return None
    pos = {r["id"]: i for i, r in enumerate(records)}
    at = np.fromiter((pos[s] for s in selection["id"].astype(str)), dtype=np.int64,
                     count=len(selection))
    ep = selection[EPOCH].to_numpy(dtype=np.int64)
    return [np.sort(at[ep == e]) for e in range(n_epochs)]
