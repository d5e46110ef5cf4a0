"""A stage's section of the config: merged over the stage's DEFAULTS (unknown keys named),
or read from a stage command's ``--config`` argument."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_text


def _is_file(value: str) -> bool:
    """Whether ``value`` names an existing file; an inline mapping longer than a file name
    may be (the paper's train sections: OSError 'File name too long') is not one."""
    if value.lstrip().startswith("{"):
        return False
    try:
        return Path(value).exists()
    except OSError:
        return False


def parse_section_arg(value: str | None, section: str) -> dict:
    """A stage's ``--config``: a YAML/JSON file path or an inline JSON/YAML mapping.

    A mapping with a ``section`` key (a whole project config) yields that section.
    """
    if not value:
        return {}
    if _is_file(value):
        try:
            cfg = yaml.safe_load(read_text(value)) or {}
        except yaml.YAMLError as e:
            raise InputError(f"malformed YAML/JSON: {e}", path=value) from e
    else:
        try:  # JSON first: YAML 1.1 reads JSON's 2e-05 as a string
            import json

            cfg = json.loads(value)
        except ValueError:
            cfg = None
        try:
            cfg = yaml.safe_load(value) if cfg is None else cfg
        except yaml.YAMLError as e:
            raise InputError(f"--config is neither a file nor valid JSON/YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise InputError("--config must be a mapping (or a file holding one)")
    if isinstance(cfg.get(section), dict):
        cfg = cfg[section]
    return cfg


def merge_section(defaults: dict[str, Any], cfg: dict[str, Any] | None, section: str,
                  free: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stage's config section merged over its DEFAULTS (deep copy, nested dicts merged),
    after :func:`check_keys`."""
    cfg = dict(cfg or {})
    check_keys(defaults, cfg, section, free)
    return merged(copy.deepcopy(defaults), cfg)


def check_keys(defaults: dict[str, Any], cfg: dict[str, Any] | None, section: str,
               free: tuple[str, ...] = ()) -> None:
    """Unknown keys, and values of another type than the default's, raise InputError naming
    `section.key`; nested dicts of DEFAULTS are checked the same way unless their key is in
    `free` (free-form maps). A null default takes any value; an int is a valid float."""
    for k, v in (cfg or {}).items():
        field = f"{section}.{k}"
        if k not in defaults:
            raise InputError(f"unknown key '{k}'; allowed here: {', '.join(sorted(defaults))}",
                             field=field)
        d = defaults[k]
        auto = k in AUTO_KEYS and _kind(d) is int
        if not _fits(d, v) and not (auto and v == "auto"):
            hint = (" (YAML reads a number without a dot, such as 1e-3, as a string: write "
                    "1.0e-3)" if isinstance(v, str) and _kind(d) in (int, float) and not auto
                    else "")
            want = f"{_KINDS[_kind(d)]} or 'auto'" if auto else _KINDS[_kind(d)]
            raise InputError(f"must be {want}, got {v!r}{hint}", field=field)
        if isinstance(d, dict) and k not in free:
            check_keys(d, v, field)


# Keys that also take the string "auto" where their default is an integer: score's,
# features' and train's max_length, measured from the run's pool by the stage that reads
# it (clusterft.modeling.lengths).
AUTO_KEYS = ("max_length",)

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list", dict: "a mapping"}


def _kind(value: Any) -> type | None:
    for t in (bool, int, float, str, list, dict):  # bool first: it is an int in Python
        if isinstance(value, t):
            return t
    return None


def _fits(default: Any, value: Any) -> bool:
    want, have = _kind(default), _kind(value)
    if default is None or want is None:
        return True
    if want is float:
        return have in (int, float)
    return have is want


def merged(defaults: dict[str, Any], cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Recursively merge a config section over a module's DEFAULTS."""
    out = dict(defaults)
    for k, v in (cfg or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merged(out[k], v)
        else:
            out[k] = v
    return out
