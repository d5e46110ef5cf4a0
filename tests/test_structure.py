"""The package's shape: stages depend only on shared helpers, and every name list is
written once (the workflow, the CLI and the stages import it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workflow" / "clusterft"

# One module per workflow stage (models: the tokenizer and base_model stages).
STAGES = {"data", "corpus", "decontaminate", "models", "score", "features", "trajectories",
          "cluster", "select", "train", "evaluate", "report"}
# Entry points and tools above the stages: they may import anything.
TOP = {"__main__", "cli", "config", "configdoc", "compare", "cost", "smk"}


def imports(path: Path) -> set[str]:
    """Package modules a file imports (top-level and inside functions), by first component."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:  # from . import a, b
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clusterft."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("clusterft."))
    return out


def graph() -> dict[str, set[str]]:
    mods = {p.stem: imports(p) for p in PKG.glob("*.py")}
    mods["pools"] = set().union(*(imports(p) for p in (PKG / "pools").glob("*.py")))
    return mods


def test_the_module_lists_cover_the_package() -> None:
    known = set(graph())
    assert STAGES <= known and TOP <= known
    assert len(known - STAGES - TOP) >= 10  # the shared helpers


def test_stages_depend_only_on_shared_helpers() -> None:
    g = graph()
    bad = {m: sorted(deps & STAGES - {m}) for m, deps in g.items() if m in STAGES}
    assert not {m: d for m, d in bad.items() if d}, "a stage imports another stage"
    helpers = set(g) - STAGES - TOP
    up = {m: sorted(g[m] & (STAGES | TOP)) for m in helpers}
    assert not {m: d for m, d in up.items() if d}, "a shared helper imports a stage or an entry point"


@pytest.mark.parametrize("pattern, home", [
    (r'"full",\s*"random",\s*"cluster"', "names.py"),
    (r"full\|random\|cluster", None),
    (r'"random",\s*"balanced"', "names.py"),
    (r"random\|balanced", None),
    (r'"truncate",\s*"reject",\s*"error"', "tokenize.py"),
    (r"truncate\|reject\|error", None),
    (r'"auto",\s*"bf16",\s*"fp32"', "precision.py"),
])
def test_each_name_list_is_written_once(pattern: str, home: str | None) -> None:
    files = [*PKG.rglob("*.py"), *(ROOT / "workflow" / "rules").glob("*.smk"),
             *(ROOT / "workflow" / "scripts").glob("*.py"), ROOT / "Snakefile"]
    hits = [f.name for f in files if re.search(pattern, f.read_text(encoding="utf-8"))]
    assert hits == ([home] if home else []), hits


def test_no_stage_module_loads_torch_at_import() -> None:
    """The Snakefile and the CLI import the stage modules' names at parse time."""
    import subprocess
    import sys

    code = ("import sys, importlib\n"
            f"for m in {sorted(STAGES | {'config', 'cli', 'names'})!r}:\n"
            "    importlib.import_module('clusterft.' + m)\n"
            "print(sorted(k for k in ('torch', 'transformers', 'peft') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
