"""A local mirror of hub datasets: filled once by the download rule, read offline by jobs.

Why a mirror and not the `datasets` cache: the hub cache is keyed by library version,
builder and config hash, so a cache filled on the submitting host may be missed by a job on
a node with another `datasets` build, and its offline fallback is silent about which copy it
took. The mirror is plain parquet in the hub's own layout, one folder per hub id:

    <root>/<owner>/<name>/README.md                     (a hub card's `configs:` block)
    <root>/<owner>/<name>/<config>/<split>-00000-of-00001.parquet
    <root>/<owner>/<name>/<config>/ORIGIN.json          (where the rows came from)

`datasets.load_dataset("<owner>/<name>", config)` takes a local folder of that relative path
before the hub and reads the card's `configs:` block as the hub does, so inside
`resolving_in(root)` lm-eval's own task YAMLs (which name hub ids) and the pools' hub ids
load from the mirror unchanged (tests/test_paper_loaders.py, tests/test_download.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import yaml

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_json, write_text

DEFAULT_CONFIG = "default"
CARD = "README.md"
ORIGIN = "ORIGIN.json"
# `datasets`' own cache of what it read from the mirror, kept inside the mirror: the user's
# ~/.cache/huggingface/datasets keys a local folder's data by its path and file names, so a
# refilled mirror could be answered from a stale entry there (seen with the stand-ins).
HF_CACHE = ".hf_cache"


def dataset_dir(root: str | os.PathLike, hub_id: str) -> Path:
    """The mirror folder of one hub dataset id ("owner/name")."""
    parts = hub_id.split("/")
    if not hub_id or any(p in ("", ".", "..") for p in parts):
        raise InputError(f"not a hub dataset id: {hub_id!r}", field="hf_dataset")
    return Path(root) / hub_id


def split_file(config: str, split: str) -> str:
    """A split's file inside the dataset folder, relative (as in a hub card)."""
    return f"{config}/{split}-00000-of-00001.parquet"


def _card_configs(folder: Path) -> dict[str, dict[str, str]]:
    card = folder / CARD
    if not card.exists():
        return {}
    text = card.read_text(encoding="utf-8")
    head = text.split("---\n")[1] if text.startswith("---\n") else ""
    block = (yaml.safe_load(head) or {}).get("configs", [])
    return {c["config_name"]: {f["split"]: f["path"] for f in c["data_files"]} for c in block}


def write_dataset(root: str | os.PathLike, hub_id: str, config: str | None,
                  splits: Mapping[str, Sequence[Mapping[str, Any]] | Any],
                  origin: Mapping[str, Any]) -> Path:
    """Write one config of a hub dataset into the mirror: a parquet file per split (rows as
    dicts or a pandas DataFrame), the card's `configs:` block merged with the configs already
    there (mmlu's subjects share one folder, as on the hub), and ORIGIN.json saying where the
    rows came from (the hub and its revision, or a stand-in and what it was built from)."""
    import pandas as pd

    config = config or DEFAULT_CONFIG
    folder = dataset_dir(root, hub_id)
    configs = _card_configs(folder)
    files = {}
    for split, rows in splits.items():
        rel = split_file(config, split)
        df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        files[split] = rel
    configs[config] = files
    block = [{"config_name": name, "data_files": [{"split": s, "path": p} for s, p in sp.items()]}
             for name, sp in sorted(configs.items())]
    write_json(folder / config / ORIGIN, dict(origin))
    write_text(folder / CARD, "---\n" + yaml.safe_dump({"configs": block}, sort_keys=False)
               + "---\n")
    return folder


def has_dataset(root: str | os.PathLike | None, hub_id: str, config: str | None = None) -> bool:
    """Whether the mirror holds this dataset (and config, if given)."""
    if root is None:
        return False
    configs = _card_configs(dataset_dir(root, hub_id))
    return bool(configs) and (config is None or (config or DEFAULT_CONFIG) in configs)


def origin(root: str | os.PathLike, hub_id: str, config: str | None = None) -> dict[str, Any]:
    """The ORIGIN.json of one mirrored config ({} when absent)."""
    path = dataset_dir(root, hub_id) / (config or DEFAULT_CONFIG) / ORIGIN
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


@contextlib.contextmanager
def resolving_in(root: str | os.PathLike | None) -> Iterator[None]:
    """Run the block with the mirror as the working directory, so hub ids given to
    `datasets.load_dataset` (ours and lm-eval's) resolve to the mirror's folders, and
    `evaluate.load("code_eval")` to the mirror's `code_eval/` metric, with `datasets`' cache in
    the mirror's own `.hf_cache` (cleared whenever the download stage refills the mirror).
    Callers pass absolute paths for everything else. `None` leaves all as it is."""
    if root is None:
        yield
        return
    root = Path(root).resolve()
    if not root.is_dir():
        raise InputError("the download mirror is missing: run the download rule first "
                         "(snakemake download) or check download.cache", path=str(root))
    import datasets.config

    old, old_cache = os.getcwd(), datasets.config.HF_DATASETS_CACHE
    os.chdir(root)
    datasets.config.HF_DATASETS_CACHE = root / HF_CACHE
    try:
        yield
    finally:
        os.chdir(old)
        datasets.config.HF_DATASETS_CACHE = old_cache
