"""A stage's section of the config: merged over the stage's DEFAULTS (unknown keys named),
or read from a stage command's ``--config`` argument."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from .errors import InputError


def parse_section_arg(value: str | None, section: str) -> dict:
    """A stage's ``--config``: a YAML/JSON file path or an inline JSON/YAML mapping.

    A mapping with a ``section`` key (a whole project config) yields that section.
    """
    if not value:
        return {}
    if Path(value).exists():
        try:
            cfg = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise InputError(f"malformed YAML/JSON: {e}", path=value) from e
    else:
        try:
            cfg = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise InputError(f"--config is neither a file nor valid JSON/YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise InputError("--config must be a mapping (or a file holding one)")
    if isinstance(cfg.get(section), dict):
        cfg = cfg[section]
    return cfg


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
