"""clusterft.pace: the log lines a user reads to learn a rule's speed within its first steps."""

from __future__ import annotations

import io
import re
import time

from clusterft.pace import Pace

LINE = re.compile(r"pace demo: step (\d+)/(\d+), ([\d.e-]+) s/step \(mean of steps (\d+)-(\d+)\); "
                  r"(\d+) left, expected finish \d\d:\d\d:\d\d UTC \(in [\d.]+ (s|min|h)\)")


def _run(total: int, sleep: float, **kw) -> list[str]:
    out = io.StringIO()
    p = Pace(total, "demo", file=out, bar=False, **kw)
    for _ in range(total):
        time.sleep(sleep)
        p.update()
    p.close()
    return out.getvalue().splitlines()


def test_first_line_after_the_first_steps_then_milestones_then_a_summary():
    lines = _run(20, 0.02, first=5, reports=4)
    pace = [LINE.search(x) for x in lines[:-1]]
    assert all(pace), lines
    steps = [int(m.group(1)) for m in pace]
    # step 1 is untimed; 5 timed steps later (step 6) the first estimate; then 10 and 15
    assert steps == [6, 10, 15], steps
    first = pace[0]
    assert (int(first.group(4)), int(first.group(5))) == (2, 6)
    assert int(first.group(6)) == 14
    rate = float(first.group(3))
    assert 0.015 < rate < 0.2  # the sleeps, not the first step's cost
    assert re.search(r"pace demo: 20 steps in \d+ s, [\d.e-]+ s/step after the first", lines[-1])


def test_expected_finish_counts_the_steps_left():
    out = io.StringIO()
    p = Pace(1000, "demo", file=out, bar=False, first=2)
    for _ in range(3):
        time.sleep(0.05)
        p.update()
    m = LINE.search(out.getvalue())
    assert m and int(m.group(6)) == 997
    # ~0.05 s/step x 997 steps left: about 50 s
    assert re.search(r"\(in (4\d|5\d|6\d) s\)", out.getvalue()), out.getvalue()


def test_short_loops_still_log_and_resumed_loops_count_from_their_start():
    lines = _run(4, 0.01, first=5)
    assert any(LINE.search(x) for x in lines), lines  # a third of the way: after step 2
    out = io.StringIO()
    p = Pace(10, "demo", initial=6, file=out, bar=False)
    for _ in range(4):
        p.update()
    p.close()
    assert "demo: 4 steps in" in out.getvalue()


def test_disabled_writes_nothing():
    out = io.StringIO()
    p = Pace(10, "demo", file=out, disable=True)
    for _ in range(10):
        p.update()
    p.close()
    assert out.getvalue() == ""
