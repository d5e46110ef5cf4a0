"""config/README.md's key reference, generated from each module's DEFAULTS (and the comment
above each key), so the docs and the code cannot drift apart (the config check validates
the same DEFAULTS: clusterft.plan.config.check_sections). `python -m clusterft.tools.configdoc`
rewrites it; tests/test_config.py fails when the committed file is out of date.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
README_PATH = ROOT / "config" / "README.md"
README_TEMPLATE = ROOT / "config" / "README.template.md"

# config section -> (module, key of its DEFAULTS or None for the whole dict)
SECTIONS: dict[str, tuple[str, str | None]] = {
    "corpus": ("clusterft.stages.data.corpus", None),
    "score": ("clusterft.stages.score", None),
    "features": ("clusterft.stages.features.representations", None),
    "cluster": ("clusterft.stages.cluster", None),
    "select": ("clusterft.stages.select", None),
    "train": ("clusterft.stages.train", None),
    "evaluate": ("clusterft.stages.evaluate", None),
    "report": ("clusterft.stages.report", None),
}
# Keys whose value is a free-form mapping (not a fixed set of sub-keys).
FREE_MAPPINGS = {"type_weights", "columns", "data_files", "sizes"}


def _defaults(module: str, key: str | None) -> dict:
    mod = importlib.import_module(module)
    d = mod.DEFAULTS
    return d[key] if key else d


# Sections shared by several stages: their keys are documented where they are defined.
SHARED = ("clusterft.modeling.lora",)


def comments(module: str) -> dict[str, str]:
    """key -> the comment lines right above `"key":` in the module source (first occurrence),
    then the keys of the shared sections (SHARED) the module does not document itself."""
    out = _comments(module)
    for shared in SHARED:
        for k, v in _comments(shared).items():
            out.setdefault(k, v)
    return out


def _comments(module: str) -> dict[str, str]:
    src = inspect.getsource(importlib.import_module(module)).splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(src):
        m = re.match(r'^\s*"(\w+)"\s*:', line)
        if not m or m.group(1) in out:
            continue
        j, text = i - 1, []
        while j >= 0 and src[j].strip().startswith("#"):
            text.insert(0, src[j].strip().lstrip("#").strip())
            j -= 1
        out[m.group(1)] = " ".join(text)
    return out


def dataset_keys() -> tuple[dict, dict[str, str]]:
    """Union of every data source's keys (data.merge_cfg checks them per source)."""
    data = importlib.import_module("clusterft.stages.data.prepare")
    keys: dict[str, Any] = {}
    docs: dict[str, str] = {}
    for mod in ("clusterft.stages.data.prepare", "clusterft.pools", "clusterft.pools.skills",
                "clusterft.pools.pycode", "clusterft.pools.icd10"):
        docs.update({k: v for k, v in comments(mod).items() if v and k not in docs})
    for source, d in data.DEFAULTS.items():
        for k, v in d.items():
            keys.setdefault(k, v)
    return keys, docs


def _rows(prefix: str, defaults: dict, docs: dict[str, str]) -> list[str]:
    rows = []
    for k, v in defaults.items():
        if isinstance(v, dict) and k not in FREE_MAPPINGS and v:
            rows += _rows(f"{prefix}{k}.", v, docs)
            continue
        shown = yaml.safe_dump(v, default_flow_style=True, width=1000).strip()
        shown = shown.removesuffix("...").strip().replace("|", "\\|")
        rows.append(f"| `{prefix}{k}` | `{shown}` | {docs.get(k, '')} |")
    return rows


def build_readme() -> str:
    parts = [README_TEMPLATE.read_text(encoding="utf-8").rstrip(), ""]
    keys, ddocs = dataset_keys()
    parts += ["### `datasets.<name>` (per source; keys a source does not use are rejected)", "",
              "| key | default | meaning |", "| --- | --- | --- |"]
    parts += _rows("", keys, ddocs) + [""]
    models = importlib.import_module("clusterft.stages.models")
    parts += ["### `tokenizer`", "", "| key | default | meaning |", "| --- | --- | --- |"]
    parts += _rows("", models.TOKENIZER_DEFAULTS, _comments("clusterft.stages.models")) + [""]
    pretrain = importlib.import_module("clusterft.modeling.pretrain")
    parts += ["### `models.<name>.pretrain` (source: build)", "", "| key | default | meaning |",
              "| --- | --- | --- |"]
    parts += _rows("", pretrain.DEFAULTS, comments("clusterft.modeling.pretrain")) + [""]
    for name, (module, key) in SECTIONS.items():
        parts += [f"### `{name}`", "", "| key | default | meaning |", "| --- | --- | --- |"]
        parts += _rows("", _defaults(module, key), comments(module)) + [""]
    return "\n".join(parts)


def main() -> int:
    README_PATH.write_text(build_readme(), encoding="utf-8")
    print(f"wrote {README_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
