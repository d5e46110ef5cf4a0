"""The workflow end to end on the smoke config (.test/config.yaml), then rerun behaviour.

Runs the real Snakefile in a temporary working directory: every rule, torchrun ranks,
lm-eval, the report. Then checks that a completed run reruns nothing and that changing
`cluster.k` reruns `cluster` and what follows, but not `score`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / ".test" / "config.yaml"


def snakemake(workdir: Path, *args: str, check: bool = True,
              configfile: Path = SMOKE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
           str(workdir), "--configfile", str(configfile), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_rules(workdir: Path, *args: str, configfile: Path = SMOKE) -> dict[str, int]:
    """Rule -> job count that a dry run would execute (from Snakemake's job stats table)."""
    out = snakemake(workdir, "-n", *args, configfile=configfile)
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    stats = text.split("Job stats:", 1)[1]
    rules = {}
    for line in stats.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            rules[m.group(1)] = int(m.group(2))
    return rules


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("smoke")
    snakemake(workdir)
    return workdir


def test_outputs_exist_and_are_real(smoke_run: Path) -> None:
    tables = smoke_run / "results" / "tables"
    acc = pd.read_csv(tables / "accuracy_vs_data.csv")
    assert set(acc["dataset"]) == {"skills", "icd10"}
    assert {"full", "random", "cluster"} <= set(acc["method"])
    assert acc["average_mean"].between(0, 1).all()
    time = pd.read_csv(tables / "time.csv")
    assert set(time["distribution"]) == {"random", "balanced"}
    assert (time["wall_time_s_mean"] > 0).all()
    for d in ("skills", "icd10"):
        for p in ("accuracy_vs_data", "time"):
            png = smoke_run / "results" / "plots" / f"{p}_{d}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads(next((smoke_run / "results" / "train").rglob("train_metrics.json")).read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] > 0
    # every rule wrote a log and a benchmark file
    for rule in ("prepare_data", "score", "cluster", "select", "train", "evaluate"):
        assert list((smoke_run / "logs" / rule).rglob("*.log")), rule
        assert list((smoke_run / "benchmarks" / "out" / rule).rglob("*.tsv")), rule


def test_html_report(smoke_run: Path) -> None:
    snakemake(smoke_run, "--report", "results/report.html")
    html = (smoke_run / "results" / "report.html").read_text(errors="replace")
    assert "accuracy_vs_data" in html


def test_completed_run_reruns_nothing(smoke_run: Path) -> None:
    assert planned_rules(smoke_run) == {}


def test_changing_k_reruns_cluster_onward_not_score(smoke_run: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load(SMOKE.read_text())
    assert cfg["cluster"]["k"] != 3
    cfg["cluster"]["k"] = 3  # the user edits cluster.k in the config file
    edited = tmp_path / "config.yaml"
    edited.write_text(yaml.safe_dump(cfg))  # keys re-sorted too: key order must not matter
    plan = planned_rules(smoke_run, configfile=edited)
    assert plan.get("cluster") == 2  # one per dataset x model x seed
    assert {"select", "train", "evaluate", "report"} <= set(plan)
    assert not {"score", "prepare_data", "base_model", "tokenizer", "corpus", "evaluate_base"} & set(plan)
