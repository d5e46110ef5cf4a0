"""Atomic file output and small readers shared by every stage.

Every output is written under a temporary name in the same folder and renamed into place,
so a killed job never leaves a file that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from clusterft.pipeline.errors import InputError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it into place only on success."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    target = tmp if is_dir else tmp / final.name
    try:
        yield target
        if is_dir:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        else:
            os.replace(target, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")


BOM = b"\xef\xbb\xbf"


def read_text(path: str | os.PathLike) -> str:
    """A user's text file as str: UTF-8 with or without a byte-order mark (Windows tools
    write one), CRLF or LF line ends (both read as LF); UnicodeDecodeError if not UTF-8."""
    text = Path(path).read_bytes().decode("utf-8-sig")
    return text.replace("\r\n", "\n")


def text_lines(f) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes) of a binary file, the first line's byte-order mark
    and every line's CR LF or LF end removed; a last line without a newline counts."""
    for lineno, raw in enumerate(f, start=1):
        if lineno == 1:
            raw = raw.removeprefix(BOM)
        yield lineno, raw.rstrip(b"\r\n")


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.exists():
        raise InputError("file does not exist", path=str(p))
    try:
        return json.loads(read_text(p))
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 ({e})", path=str(p)) from e
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON: {e.msg}", path=str(p), line=e.lineno) from e


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file; errors name the file and the line."""
    p = Path(path)
    if not p.exists():
        raise InputError("file does not exist; check the path in the config", path=str(p))
    out: list[dict] = []
    with open(p, "rb") as f:
        for lineno, raw in text_lines(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"not valid UTF-8 ({e.reason} at byte {e.start})",
                                 path=str(p), line=lineno) from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"malformed JSON: {e.msg} (column {e.colno})",
                                 path=str(p), line=lineno) from e
            if not isinstance(rec, dict):
                raise InputError("each line must be a JSON object", path=str(p), line=lineno)
            out.append(rec)
    return out


def write_parquet(path: str | os.PathLike, df: "pandas.DataFrame") -> None:  # noqa: F821
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)


def save_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array)


def set_offline_env(allow_downloads: bool = False) -> None:
    """Make HF libraries work offline (and skip their telemetry) unless downloads are allowed."""
    if allow_downloads:
        return
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
