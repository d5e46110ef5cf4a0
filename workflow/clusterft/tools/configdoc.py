"""config/README.md, generated so that the docs and the code cannot drift apart.

Two parts:
- the top-level table: every key of the JSON schema (`workflow/schemas/config.schema.yaml`,
  with the enums the code owns filled in by `clusterft.plan.config.schema`), one row per key
  and per group, with its default and its meaning: the schema's description, or the longer
  note written for that key in `config/README.template.md`'s "Top level" table;
- the stage sections: each module's DEFAULTS (and the comment above each key), the same
  DEFAULTS the config check validates against (`clusterft.plan.config.check_sections`).

`python -m clusterft.tools.configdoc` rewrites the file; tests/test_config.py fails when the
committed file is out of date, tests/test_configdoc.py when a schema or DEFAULTS key is
missing from it or a table row does not have the header's cells.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[3]
README_PATH = ROOT / "config" / "README.md"
README_TEMPLATE = ROOT / "config" / "README.template.md"

# config section -> (module, key of its DEFAULTS or None for the whole dict)
SECTIONS: dict[str, tuple[str, str | None]] = {
    "download": ("clusterft.stages.download", None),
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
# Schema $defs that are stage sections (keys from DEFAULTS) -> the heading documenting them.
SECTION_HEADINGS = {**{name: f"`{name}`" for name in SECTIONS},
                    "tokenizer": "`tokenizer`",
                    "pretrain": "`models.<name>.pretrain` (source: build)",
                    "practice": "`models.<name>.practice` (source: build)"}
TOP_HEADING = "## Top level"
HEADER = ["key", "default", "meaning"]


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


def practice_comments() -> dict[str, str]:
    """The comments of PRACTICE_DEFAULTS' keys: its keys (steps, n, lr ...) also occur
    earlier in clusterft.stages.models with other meanings, so reading starts at the dict."""
    return _comments("clusterft.stages.models", start="PRACTICE_DEFAULTS: dict = {")


def _comments(module: str, start: str | None = None) -> dict[str, str]:
    """key -> the comment lines right above its first `"key":` in the module source, read
    from the line holding ``start`` on when given."""
    src = inspect.getsource(importlib.import_module(module)).splitlines()
    if start is not None:
        src = src[next(i for i, line in enumerate(src) if start in line):]
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
                "clusterft.pools.pycode", "clusterft.pools.icd10", "clusterft.pools.cipher"):
        docs.update({k: v for k, v in comments(mod).items() if v and k not in docs})
    for source, d in data.DEFAULTS.items():
        for k, v in d.items():
            keys.setdefault(k, v)
    return keys, docs


# ------------------------------------------------------------------ cells and rows


class _Dumper(yaml.SafeDumper):
    """YAML flow style on one line: a string holding a newline, a tab or another
    non-printable character is written double-quoted with escapes ("\\n"), never folded."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = '"' if not value.isprintable() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def show(value: Any) -> str:
    """A default as one line of YAML flow style (how it is written in a config file)."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=10**9,
                     allow_unicode=True).strip()
    text = text.removesuffix("...").strip()
    return " ".join(text.splitlines())  # a safety net: a cell never spans two lines


def code(text: str) -> str:
    """`text` as a code span for a table cell ('|' escaped, backticks fenced)."""
    text = text.replace("|", "\\|")
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`"


def cell(text: str) -> str:
    """Prose for a table cell: one line, every '|' not already escaped escaped."""
    text = " ".join(str(text).split())
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row ('\\|' does not split)."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


def table(rows: list[str]) -> list[str]:
    return [row(*HEADER), row(*["---"] * len(HEADER)), *rows]


def _rows(prefix: str, defaults: dict, docs: dict[str, str]) -> list[str]:
    rows = []
    for k, v in defaults.items():
        if isinstance(v, dict) and k not in FREE_MAPPINGS and v:
            rows += _rows(f"{prefix}{k}.", v, docs)
            continue
        rows.append(row(code(f"{prefix}{k}"), code(show(v)), cell(docs.get(k, ""))))
    return rows


# ------------------------------------------------------------------ the schema's keys


def _resolve(node: dict, schema: dict) -> tuple[dict, str | None]:
    """A schema node with its $ref followed (the referring node's own fields win), and the
    name of the $def it points to (None without a $ref)."""
    ref = node.get("$ref")
    if not ref:
        return node, None
    name = ref.rsplit("/", 1)[-1]
    return {**schema["$defs"][name], **{k: v for k, v in node.items() if k != "$ref"}}, name


def schema_keys(schema: dict) -> Iterator[tuple[str, dict, str | None, bool]]:
    """Every key of the schema, depth first in the schema's order: (dotted path, node with
    $ref resolved, the stage section's $def name if it is one, required?). A mapping of
    user-named entries (datasets, models) is `<name>`; a stage section is not descended into
    (its keys are its module's DEFAULTS)."""

    def walk(node: dict, prefix: str) -> Iterator[tuple[str, dict, str | None, bool]]:
        required = set(node.get("required", ()))
        for name, sub in node.get("properties", {}).items():
            sub, ref = _resolve(sub, schema)
            path = f"{prefix}{name}"
            section = ref if ref in SECTION_HEADINGS else None
            yield path, sub, section, name in required
            if section:
                continue
            yield from walk(sub, f"{path}.")
            extra = sub.get("additionalProperties")
            if isinstance(extra, dict):
                entry, _ = _resolve(extra, schema)
                if "properties" in entry:
                    yield f"{path}.<name>", entry, None, False
                    yield from walk(entry, f"{path}.<name>.")

    yield from walk(schema, "")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return "#" + re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _enum(node: dict) -> list | None:
    return node.get("enum") or (node.get("items") or {}).get("enum")


def template_notes(template: str) -> dict[str, str]:
    """key -> meaning of the template's "Top level" table (a '|' not escaped is escaped)."""
    lines = template.splitlines()
    first, end = _top_table(lines)
    notes: dict[str, str] = {}
    for line in lines[first:end]:
        key, *rest = split_row(line)
        if key.startswith("`") and key.endswith("`"):
            notes[key.strip("`")] = cell(" | ".join(rest))
    return notes


def _top_table(lines: list[str]) -> tuple[int, int]:
    """[first, end) lines of the first table after the "Top level" heading."""
    start = lines.index(TOP_HEADING) + 1
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")),
               len(lines))
    return first, end


def top_level_rows(schema: dict, notes: dict[str, str]) -> list[str]:
    """One row per schema key: default ('required' where the schema requires it) and the
    template's note for it, else the schema's description; the values an enum allows."""
    rows, seen = [], set()
    for path, node, section, required in schema_keys(schema):
        seen.add(path)
        default = code(show(node["default"])) if "default" in node else (
            "required" if required else "")
        names = _enum(node)
        described = node.get("description") or (node.get("items") or {}).get("description", "")
        if names and described.startswith("one of "):
            described = ""  # a pointer to the code's name list, which `names` spells out
        meaning = notes[path] if path in notes else cell(described.rstrip("."))
        if names:
            meaning = (meaning + "; " if meaning else "") + "one of " + " \\| ".join(
                f"`{n}`" for n in names)
        if section:
            heading = SECTION_HEADINGS[section]
            link = f"keys and defaults: [{heading}]({_anchor(heading)}) below"
            meaning = f"{meaning}; {link}" if path in notes else link
        rows.append(row(code(path), default, meaning))
    unknown = sorted(set(notes) - seen)
    if unknown:
        raise ValueError(f"{README_TEMPLATE}: the Top level table names keys the schema does "
                         f"not have: {', '.join(unknown)}")
    return rows


def _with_top_level(template: str, rows: list[str]) -> list[str]:
    """The template with its "Top level" table replaced by the generated one."""
    lines = template.rstrip().splitlines()
    first, end = _top_table(lines)
    return lines[:first] + table(rows) + lines[end:]


def build_readme() -> str:
    from clusterft.plan.config import schema

    template = README_TEMPLATE.read_text(encoding="utf-8")
    parts = _with_top_level(template, top_level_rows(schema(), template_notes(template)))
    parts.append("")
    keys, ddocs = dataset_keys()
    parts += ["### `datasets.<name>` (per source; keys a source does not use are rejected)", ""]
    parts += table(_rows("", keys, ddocs)) + [""]
    models = importlib.import_module("clusterft.stages.models")
    parts += [f"### {SECTION_HEADINGS['tokenizer']}", ""]
    parts += table(_rows("", models.TOKENIZER_DEFAULTS,
                         _comments("clusterft.stages.models"))) + [""]
    pretrain = importlib.import_module("clusterft.modeling.pretrain")
    parts += [f"### {SECTION_HEADINGS['pretrain']}", ""]
    parts += table(_rows("", pretrain.DEFAULTS, comments("clusterft.modeling.pretrain"))) + [""]
    parts += [f"### {SECTION_HEADINGS['practice']}", ""]
    parts += table(_rows("", models.PRACTICE_DEFAULTS, practice_comments())) + [""]
    for name, (module, key) in SECTIONS.items():
        parts += [f"### {SECTION_HEADINGS[name]}", ""]
        parts += table(_rows("", _defaults(module, key), comments(module))) + [""]
    return "\n".join(parts)


def main() -> int:
    README_PATH.write_text(build_readme(), encoding="utf-8")
    print(f"wrote {README_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
