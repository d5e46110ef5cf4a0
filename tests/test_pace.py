"""clusterft.pipeline.pace: the log lines a user reads to learn a rule's speed within its first steps."""

from __future__ import annotations

import io
import re

import pytest

from clusterft.pipeline.pace import Pace

LINE = re.compile(r"pace demo: (step|batch) (\d+)/(\d+), ([\d.e-]+) s/(?:step|batch) "
                  r"\(mean of (?:steps|batches) (\d+)-(\d+)\); (\d+) left, expected finish "
                  r"\d\d:\d\d:\d\d UTC \(in ([\d.]+) (s|min|h)\)")


class Clock:
    """A fake perf_counter: each step takes `dt` seconds; the first step `first` seconds."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(total: int, dt: float = 0.5, first_cost: float = 30.0, initial: int = 0, **kw):
    out, clock = io.StringIO(), Clock()
    p = Pace(total, "demo", file=out, bar=False, clock=clock, initial=initial, **kw)
    for i in range(initial, total):
        clock.t += first_cost if i == initial else dt
        p.update()
    p.close()
    return out.getvalue().splitlines()


def test_first_line_after_the_first_steps_then_milestones_then_a_summary():
    lines = _run(20, first=5, reports=4)
    pace = [LINE.search(x) for x in lines[:-1]]
    assert all(pace), lines
    # step 1 is untimed; 5 timed steps later (step 6) the first estimate; then 10 and 15
    assert [int(m.group(2)) for m in pace] == [6, 10, 15]
    first = pace[0]
    assert (int(first.group(5)), int(first.group(6))) == (2, 6)
    assert float(first.group(4)) == pytest.approx(0.5)  # the steps, not the first step's 30 s
    assert int(first.group(7)) == 14 and first.group(8) == "7" and first.group(9) == "s"
    assert re.search(r"pace demo: 20 steps in 40 s, 0.5 s/step after the first", lines[-1])


def test_expected_finish_counts_the_steps_left():
    out, clock = io.StringIO(), Clock()
    p = Pace(1000, "demo", file=out, bar=False, first=2, clock=clock)
    for _ in range(3):
        clock.t += 0.3
        p.update()
    m = LINE.search(out.getvalue())
    assert m and int(m.group(7)) == 997
    assert m.group(8) == "5.0" and m.group(9) == "min"  # 997 x 0.3 s = 299 s


def test_resumed_loops_count_from_their_start_and_plural_units():
    lines = _run(10, initial=6, unit="batch", units="batches")
    m = next(LINE.search(x) for x in lines if LINE.search(x))
    # resumed at 6: batch 7 is untimed, the first estimate after batch 8 (a third of 4 left)
    assert m.group(1) == "batch" and (int(m.group(5)), int(m.group(6))) == (8, 8)
    assert int(m.group(7)) == 2
    assert "demo: 4 batches in" in lines[-1]


@pytest.mark.parametrize("total", [3, 4, 6, 7])
def test_short_loops_log_once_not_every_step(total):
    pace = [x for x in _run(total, first=5) if LINE.search(x)]
    assert 1 <= len(pace) <= 2, pace


def test_disabled_writes_nothing_and_close_is_idempotent():
    out = io.StringIO()
    p = Pace(10, "demo", file=out, disable=True)
    for _ in range(10):
        p.update()
    p.close()
    assert out.getvalue() == ""
    out = io.StringIO()
    with Pace(5, "demo", file=out, bar=False) as p:
        p.update()
        p.close()
    assert out.getvalue().count("demo: 1 step in") == 1


def test_context_manager_writes_the_summary_when_the_loop_raises():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Pace(10, "demo", file=out, bar=False) as p:
            p.update()
            p.update()
            raise RuntimeError("boom")
    assert "demo: 2 steps in" in out.getvalue()


# ------------------------------------------------------------ bar on a terminal, lines in logs

class FakeTTY(io.StringIO):
    """A terminal stand-in: tqdm draws its bar here."""

    def isatty(self) -> bool:
        return True


def _loop(total: int = 30, **kw) -> None:
    with Pace(total, "demo", mininterval=0, **kw) as p:
        for _ in range(total):
            p.update()


def test_a_log_file_gets_pace_lines_and_no_bar(tmp_path, monkeypatch):
    """stderr sent to a file, as clusterft.pipeline.smk.logged does for a rule's log."""
    import sys

    log = tmp_path / "rule.log"
    with open(log, "w", encoding="utf-8") as f:
        monkeypatch.setattr(sys, "stderr", f)
        _loop()
    text = log.read_text()
    assert "\r" not in text and "%|" not in text, text[:500]
    lines = text.splitlines()
    assert lines and all(" pace demo: " in x for x in lines), lines
    assert LINE.search(text) and "demo: 30 steps in" in lines[-1]


def test_a_shell_redirected_stderr_gets_no_bar(tmp_path):
    """`... 2> log` (train's rule): the process's own stderr is a file, not a terminal."""
    import subprocess
    import sys

    log = tmp_path / "train.log"
    code = ("from clusterft.pipeline.pace import Pace\n"
            "with Pace(40, 'demo', mininterval=0) as p:\n"
            "    for _ in range(40):\n"
            "        p.update()\n")
    with open(log, "w", encoding="utf-8") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True, timeout=120)
    text = log.read_text()
    assert "\r" not in text and "pace demo: step" in text, text[:500]
    assert all(" pace demo: " in x for x in text.splitlines())


def test_a_terminal_gets_the_bar_and_the_lines():
    tty = FakeTTY()
    _loop(file=tty)
    text = tty.getvalue()
    assert "\r" in text and "30/30" in text  # tqdm's bar
    assert LINE.search(text) and "pace demo: 30 steps in" in text
    quiet = FakeTTY()
    _loop(file=quiet, bar=False)
    assert "\r" not in quiet.getvalue() and "pace demo: 30 steps in" in quiet.getvalue()


def test_corpus_progress_goes_through_pace(tmp_path, monkeypatch):
    import sys

    from clusterft.stages.data.corpus import run_corpus

    log = tmp_path / "corpus.log"
    with open(log, "w", encoding="utf-8") as f:
        monkeypatch.setattr(sys, "stderr", f)
        run_corpus({"topics_chars": 20_000, "stdlib_chars": 20_000, "icd10_chars": 5_000},
                   tmp_path / "c.txt", [], seed=0)
    text = log.read_text()
    assert "\r" not in text, text[:500]
    assert "pace corpus topics: " in text and "pace corpus stdlib: " in text


def test_other_libraries_bars_only_on_a_terminal():
    """bars_only_on_terminal (lm-eval's bars in evaluate): a file gets no bar, a terminal
    does, a bar its caller turned off stays off, and tqdm is itself again afterwards."""
    from tqdm import tqdm

    from clusterft.pipeline.pace import bars_only_on_terminal, on_terminal

    with bars_only_on_terminal():
        log, tty, off = io.StringIO(), FakeTTY(), FakeTTY()
        assert sum(tqdm(range(5), file=log)) == 10
        assert sum(tqdm(range(5), file=log, disable=False)) == 10
        list(tqdm(range(5), file=tty, desc="x"))
        list(tqdm(range(5), file=off, disable=True))
    assert log.getvalue() == "" and off.getvalue() == ""
    assert "\r" in tty.getvalue() and "5/5" in tty.getvalue()
    after = io.StringIO()
    list(tqdm(range(5), file=after))
    assert "5/5" in after.getvalue()
    assert on_terminal(FakeTTY()) and not on_terminal(io.StringIO()) and not on_terminal(object())
