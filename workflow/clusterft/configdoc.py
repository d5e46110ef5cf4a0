"""The config schema's stage sections and config/README.md's key reference, generated from
each module's DEFAULTS (and the comment above each key), so the schema, the docs and the
code cannot drift apart. `python -m clusterft.configdoc` rewrites both files;
tests/test_config.py fails when a committed file is out of date.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_TEMPLATE = ROOT / "workflow" / "schemas" / "config.schema.template.yaml"
README_PATH = ROOT / "config" / "README.md"
README_TEMPLATE = ROOT / "config" / "README.template.md"

# config section -> (module, key of its DEFAULTS or None for the whole dict)
SECTIONS: dict[str, tuple[str, str | None]] = {
    "corpus": ("clusterft.corpus", None),
    "score": ("clusterft.score", None),
    "cluster": ("clusterft.cluster", None),
    "select": ("clusterft.select", None),
    "train": ("clusterft.train", None),
    "evaluate": ("clusterft.evaluate", None),
    "report": ("clusterft.report", None),
}
# Keys whose value is a free-form mapping (not a fixed set of sub-keys).
FREE_MAPPINGS = {"type_weights", "columns", "pretrain_by_size", "data_files", "sizes"}
TOKENIZER = {
    # documented here: the tokenizer section has no DEFAULTS dict of its own
    "source": ("build", "build (train a byte-level BPE on the corpus) | hub | path"),
    "vocab_size": (2048, "vocabulary size of the built tokenizer (bytes + merges + 3 specials)"),
    "hub_id": (None, "source: hub -> a hub model/tokenizer id (needs allow_downloads)"),
    "path": (None, "source: path -> a local tokenizer folder"),
}


def _defaults(module: str, key: str | None) -> dict:
    mod = importlib.import_module(module)
    d = mod.DEFAULTS
    return d[key] if key else d


# Sections shared by several stages: their keys are documented where they are defined.
SHARED = ("clusterft.lora",)


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


def _type(value: Any) -> dict:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array"}
    if isinstance(value, dict):
        return {"type": "object"}
    return {}


def section_schema(defaults: dict, docs: dict[str, str]) -> dict:
    props = {}
    for k, v in defaults.items():
        if isinstance(v, dict) and k not in FREE_MAPPINGS:
            props[k] = section_schema(v, docs)
        else:
            props[k] = {**_type(v)}
            if v is None:
                props[k] = {}
        if docs.get(k):
            props[k]["description"] = docs[k]
    return {"type": "object", "additionalProperties": False, "default": {}, "properties": props}


def dataset_keys() -> tuple[dict, dict[str, str]]:
    """Union of every data source's keys (data.merge_cfg checks them per source)."""
    data = importlib.import_module("clusterft.data")
    keys: dict[str, Any] = {}
    docs: dict[str, str] = {}
    for mod in ("clusterft.data", "clusterft.pools", "clusterft.pools.skills",
                "clusterft.pools.pycode", "clusterft.pools.icd10"):
        docs.update({k: v for k, v in comments(mod).items() if v and k not in docs})
    for source, d in data.DEFAULTS.items():
        for k, v in d.items():
            keys.setdefault(k, v)
    return keys, docs


def build_schema() -> dict:
    schema = yaml.safe_load(SCHEMA_TEMPLATE.read_text(encoding="utf-8"))
    defs = schema["$defs"]
    for name, (module, key) in SECTIONS.items():
        defs[name] = section_schema(_defaults(module, key), comments(module))
    pretrain = importlib.import_module("clusterft.pretrain")
    defs["pretrain"] = section_schema(pretrain.DEFAULTS, comments("clusterft.pretrain"))
    defs["tokenizer"] = {
        "type": "object", "additionalProperties": False, "default": {},
        "properties": {k: {**(_type(v) if v is not None else {"type": "string"}), "description": d}
                       for k, (v, d) in TOKENIZER.items()},
    }
    defs["tokenizer"]["properties"]["source"] = {"enum": ["build", "hub", "path"],
                                                 "description": TOKENIZER["source"][1]}
    keys, ddocs = dataset_keys()
    ds = defs["dataset"]["properties"]
    for k, v in keys.items():
        if k in ds:
            continue
        ds[k] = {} if v is None else _type(v)
        if ddocs.get(k):
            ds[k]["description"] = ddocs[k]
    return schema


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
    parts += ["### `tokenizer`", "", "| key | default | meaning |", "| --- | --- | --- |"]
    parts += [f"| `{k}` | `{v}` | {d} |" for k, (v, d) in TOKENIZER.items()] + [""]
    pretrain = importlib.import_module("clusterft.pretrain")
    parts += ["### `models.<name>.pretrain` (source: build)", "", "| key | default | meaning |",
              "| --- | --- | --- |"]
    parts += _rows("", pretrain.DEFAULTS, comments("clusterft.pretrain")) + [""]
    for name, (module, key) in SECTIONS.items():
        parts += [f"### `{name}`", "", "| key | default | meaning |", "| --- | --- | --- |"]
        parts += _rows("", _defaults(module, key), comments(module)) + [""]
    return "\n".join(parts)


def render_schema() -> str:
    header = ("# GENERATED by `python -m clusterft.configdoc` from config.schema.template.yaml and\n"
              "# the modules' DEFAULTS. Edit those, not this file.\n")
    return header + yaml.safe_dump(build_schema(), sort_keys=False, width=100, allow_unicode=True)


def main() -> int:
    SCHEMA_PATH.write_text(render_schema(), encoding="utf-8")
    README_PATH.write_text(build_readme(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH} and {README_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
