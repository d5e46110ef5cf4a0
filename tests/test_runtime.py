"""freeze_for_exit: the process still exits normally (atexit runs, buffers are flushed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import atexit, gc, sys
from pathlib import Path
from clusterft.runtime import freeze_for_exit
out = Path(sys.argv[1])
atexit.register(lambda: out.write_text("atexit ran"))
cycle = []; cycle.append(cycle)  # garbage the collector would otherwise visit at exit
sys.stdout.write("unflushed output")
freeze_for_exit()
assert gc.isenabled() and gc.get_freeze_count() > 0
"""


def test_freeze_for_exit_keeps_a_normal_exit(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow")}
    marker = tmp_path / "marker.txt"
    r = subprocess.run([sys.executable, "-c", CHILD, str(marker)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "unflushed output"
    assert marker.read_text() == "atexit ran"
