"""Config loading and the checks that go beyond the JSON schema.

The schema (`workflow/schemas/config.schema.yaml`) rejects unknown keys and wrong types;
`check_config` then checks what a schema cannot (paths that must exist, tasks that must be
defined, cluster counts against pool sizes), before any expensive stage starts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from .errors import InputError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"
METHODS = ("full", "random", "cluster")
DISTRIBUTIONS = ("random", "balanced")


def budget_label(budget: float) -> str:
    """Budget as it appears in paths: 0.31 -> '0.31', 1.0 -> '1'."""
    return f"{float(budget):g}"


def load_config(path: str | Path, validate: bool = True) -> dict:
    """Read a YAML config, validate it against the schema and the extra checks."""
    p = Path(path)
    if not p.exists():
        raise InputError("config file does not exist", path=str(p))
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise InputError(f"malformed YAML: {e}", path=str(p)) from e
    if validate:
        validate_schema(cfg, source=str(p))
        check_config(cfg, source=str(p))
    return cfg


def validate_schema(cfg: dict, source: str = "config") -> None:
    """Validate against the JSON schema (as Snakemake does), filling schema defaults."""
    import jsonschema

    schema = yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(cfg), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        field = ".".join(str(x) for x in e.absolute_path) or "(top level)"
        raise InputError(e.message, path=source, field=field)


def tasks_for(cfg: dict, dataset: str) -> list[str]:
    """Benchmark task names evaluated for the runs of one dataset.

    Repo-defined tasks: those drawn from the dataset's own source (held-out items of the same
    generator), optionally restricted by `benchmarks.tasks`. With `benchmarks.lm_eval_tasks`
    (paper config): the lm-eval tasks of the dataset's domain.
    """
    bench = cfg.get("benchmarks", {})
    spec = cfg["datasets"][dataset]
    named = bench.get("lm_eval_tasks")
    if named:
        return list(named.get(spec["domain"], []))
    from .benchmarks import TASKS

    only = bench.get("tasks")
    source = spec.get("source", dataset)
    return [t.name for t in TASKS.values()
            if t.dataset == source and (not only or t.name in only)]


def check_config(cfg: dict, source: str = "config") -> None:
    """Checks a schema cannot express; each error names the config field."""
    sweep = cfg["sweep"]
    for i, b in enumerate(sweep["budgets"]):
        if not 0 < float(b) <= 1:
            raise InputError(f"budget {b} is outside (0, 1]", path=source, field=f"sweep.budgets[{i}]")
    for key in ("methods",):
        for i, m in enumerate(sweep[key]):
            if m not in METHODS:
                raise InputError(f"unknown method '{m}'; valid: {', '.join(METHODS)}",
                                 path=source, field=f"sweep.{key}[{i}]")
    k = cfg.get("cluster", {}).get("k")
    for name, d in cfg["datasets"].items():
        n = d.get("n")
        if k is not None and n is not None and k > n:
            raise InputError(f"cluster.k = {k} is larger than the pool size n = {n}",
                             path=source, field=f"datasets.{name}.n")
    for name, m in cfg["models"].items():
        if m.get("source") == "path" and not Path(m["path"]).exists():
            raise InputError(f"model path '{m['path']}' does not exist", path=source,
                             field=f"models.{name}.path")
        if m.get("source") == "hub" and not cfg.get("allow_downloads", False):
            local = m.get("path")
            if not (local and Path(local).exists()):
                # Allowed for dry runs (-n): the base_model rule raises before downloading.
                pass
    for name, d in cfg["datasets"].items():
        if d.get("source") == "jsonl" and not Path(d["path"]).exists():
            raise InputError(f"dataset file '{d['path']}' does not exist", path=source,
                             field=f"datasets.{name}.path")
    named = cfg.get("benchmarks", {}).get("lm_eval_tasks")
    if not named:
        from .benchmarks import TASKS

        for i, t in enumerate(cfg.get("benchmarks", {}).get("tasks", []) or []):
            if t not in TASKS:
                raise InputError(f"benchmark task '{t}' is not defined; defined: {', '.join(TASKS)}",
                                 path=source, field=f"benchmarks.tasks[{i}]")
        for name in cfg["datasets"]:
            if not tasks_for(cfg, name):
                raise InputError(f"no benchmark task evaluates dataset '{name}' (tasks come from the "
                                 f"skills/pycode/icd10 generators, or set benchmarks.lm_eval_tasks); "
                                 f"defined tasks: {', '.join(TASKS)}", path=source,
                                 field=f"datasets.{name}")


def merge_section(defaults: dict[str, Any], cfg: dict[str, Any] | None, section: str,
                  free: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stage's config section merged over its DEFAULTS (deep copy, nested dicts merged).

    Unknown keys raise InputError naming `section.key` and listing the known ones; nested
    dicts of DEFAULTS are checked the same way unless their key is in `free` (free-form maps).
    """
    cfg = dict(cfg or {})
    for k, v in cfg.items():
        if k not in defaults:
            raise InputError(f"unknown key '{k}'; known keys: "
                             f"{sorted(defaults)}", field=f"{section}.{k}")
        if isinstance(defaults[k], dict) and isinstance(v, dict) and k not in free:
            merge_section(defaults[k], v, f"{section}.{k}")
    return merged(copy.deepcopy(defaults), cfg)


def merged(defaults: dict[str, Any], cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Recursively merge a config section over a module's DEFAULTS."""
    out = dict(defaults)
    for k, v in (cfg or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merged(out[k], v)
        else:
            out[k] = v
    return out
