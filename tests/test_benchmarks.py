"""Each benchmark with a smoke mode runs from its one command and prints its ratios last
(CI keeps them working; their figures at smoke sizes mean nothing and are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,last", [("bench_cluster.py", "growth exponent"),
                                         ("bench_projection.py", "ratios")])
def test_benchmark_smoke_runs_and_prints_ratios_last(script: str, last: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    tail = out.stdout.strip().splitlines()[-8:]
    assert any(last in line for line in tail), out.stdout[-2000:]
    assert any("x" in line and any(c.isdigit() for c in line) for line in tail)
