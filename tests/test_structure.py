"""The package's shape, checked on folder membership: every stage mirrors a rule file, a
layer imports only the layers below it (docs/design.md, "Layers"), and every name list is
written once (the workflow, the CLI and the stages import it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workflow" / "clusterft"

# Which layers each layer may import (its own included). A layer is a top-level folder or
# module of the package; the order is the one docs/design.md draws.
ALLOWED = {
    "pipeline": {"pipeline"},
    "modeling": {"pipeline", "modeling"},
    "sampler": {"pipeline", "sampler"},
    "pools": {"pipeline", "modeling", "pools"},
    "tasks": {"pipeline", "modeling", "pools", "tasks"},
    "analysis": {"pipeline", "modeling", "sampler", "analysis"},
}
HELPERS = set(ALLOWED)
ALLOWED["stages"] = HELPERS | {"stages"}
ALLOWED["plan"] = HELPERS | {"stages", "plan"}
ALLOWED["tools"] = HELPERS | {"stages", "plan", "tools"}
ENTRY = {"cli", "__main__", "__init__"}  # may import anything


def module_name(path: Path) -> str:
    """Dotted name of a package file, relative to clusterft ('' for the package itself)."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, me: str | None = None) -> set[str]:
    """What a file imports from the package (top-level and inside functions), as dotted names
    relative to clusterft: `from M import x` gives M.x (x may be a submodule or a name in M,
    either way it lies in M's layer and stage)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = module_name(path) if me is None else me
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            up = base[: len(base) - (node.level - 1)]
            mod = ".".join([*up, *([node.module] if node.module else [])])
            out.update(f"{mod}.{a.name}".strip(".") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "clusterft":
            mod = node.module.removeprefix("clusterft").lstrip(".")
            out.update(f"{mod}.{a.name}".strip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("clusterft.") for a in node.names
                       if a.name.startswith("clusterft."))
    return out


def layer(name: str) -> str:
    return name.split(".")[0] if name else "__init__"


def stage(name: str) -> str | None:
    """The stage a module belongs to (stages.<stage>...), else None."""
    parts = name.split(".")
    return parts[1] if parts[0] == "stages" and len(parts) > 1 else None


def modules() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PKG.rglob("*.py")}


def test_every_module_sits_in_a_known_layer() -> None:
    unknown = sorted(m for m in modules() if layer(m) not in ALLOWED and layer(m) not in ENTRY)
    assert not unknown, f"modules outside the layers of docs/design.md: {unknown}"


def test_the_stages_mirror_the_rule_files() -> None:
    rules = {p.stem for p in (ROOT / "workflow" / "rules").glob("*.smk")} - {"common"}
    stages = {p.stem for p in (PKG / "stages").iterdir()
              if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
    assert stages == rules


def test_each_layer_imports_only_the_layers_below_it() -> None:
    bad = {m: sorted(d for d in deps if layer(d) not in ALLOWED[layer(m)])
           for m, deps in modules().items() if layer(m) in ALLOWED}
    assert not {m: d for m, d in bad.items() if d}


def test_a_stage_never_imports_another_stage() -> None:
    bad = {m: sorted(d for d in deps if stage(d) and stage(d) != stage(m))
           for m, deps in modules().items() if stage(m)}
    assert not {m: d for m, d in bad.items() if d}, "stages talk through files, not imports"


def test_the_layer_check_sees_a_violation(tmp_path: Path) -> None:
    """The checker itself: an upward import is caught, in relative and absolute form."""
    f = tmp_path / "probe.py"
    f.write_text("from ..stages import train\nfrom clusterft.analysis.stats import mean\n"
                 "from .io import atomic\n")
    deps = imports(f, me="pipeline.probe")
    assert deps == {"stages.train", "analysis.stats.mean", "pipeline.io.atomic"}
    assert {layer(d) for d in deps} - ALLOWED["pipeline"] == {"stages", "analysis"}
    assert stage("stages.train") == "train" and stage("pipeline.io") is None


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

    names = sorted({m for m in modules() if stage(m) and "." not in m.split(".", 2)[-1]}
                   | {"plan.config", "plan.sweep", "plan.inputs", "cli", "pipeline.names"})
    code = ("import sys, importlib\n"
            f"for m in {names!r}:\n"
            "    importlib.import_module('clusterft.' + m)\n"
            "print(sorted(k for k in ('torch', 'transformers', 'peft') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
