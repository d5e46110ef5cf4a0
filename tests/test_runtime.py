"""freeze_for_exit: the process still exits normally (atexit runs, buffers are flushed);
end_rank: a rank of a multi-rank job ends at once with its output flushed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import atexit, gc, sys
from pathlib import Path
from clusterft.pipeline.runtime import freeze_for_exit
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


RANK = """
import logging, sys, threading, time
from clusterft.pipeline.runtime import end_rank
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
# a thread that would hold a normal shutdown for a minute (as a library's worker can)
threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
sys.stdout.write("unflushed output")
logging.info("logged line")
end_rank(0)
print(" returned")
"""


def test_end_rank_exits_at_once_with_output_flushed_under_a_multi_rank_launch() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow"), "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "unflushed output"
    assert "logged line" in r.stderr


def test_end_rank_returns_in_a_single_process_run() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow"), "WORLD_SIZE": "1"}
    r = subprocess.run([sys.executable, "-c", RANK.replace("args=(60,)", "args=(0,)")], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "unflushed output returned\n"
