"""Progress of a long loop for the person waiting on it: a tqdm bar on a terminal, plus plain
log lines with the measured seconds per step and the expected finish time.

In a Snakemake job's log a tqdm bar is a stream of carriage returns that nobody reads while
the job runs (and `grep pace logs/` would return the bar's text joined to each line), so the
bar is drawn only when its stream is a terminal (tqdm's ``disable=None``); a log file gets the
pace lines alone. One line soon after the start ("0.42 s/step ... expected finish 18:52:10
UTC (in 8.3 min)") tells a user within a minute that a rule will take hours, e.g. because
bf16 is emulated on their CPU, instead of after it. The first step is left out of the rate:
it pays for one-time work (kernel selection, allocator warm-up, lazy imports).

:func:`bars_only_on_terminal` does the same for other libraries' bars (lm-eval's).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import sys
import time
from typing import IO, Any, Callable, Iterator

from tqdm import tqdm


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stderr``) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


# tqdm.__init__'s positional parameters before ``disable`` (iterable .. ascii)
_BEFORE_DISABLE = 10


@contextlib.contextmanager
def bars_only_on_terminal() -> Iterator[None]:
    """Within: every tqdm bar that its caller did not turn off is drawn only on a terminal.

    For libraries that draw bars of their own (lm-eval's request and task-building bars):
    their ``disable=False`` becomes tqdm's ``disable=None`` (off unless the bar's stream is
    a TTY), so a rule's log holds no carriage-return bar text. Bars the caller disabled stay
    off. Only the display changes; the loops run as before.
    """
    from tqdm import std

    saved = std.tqdm.__dict__["__init__"]
    init = std.tqdm.__init__  # a plain function (or an env-var partialmethod's unbound form)

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        if len(args) <= _BEFORE_DISABLE and not kw.get("disable"):
            kw["disable"] = None
        init(self, *args, **kw)

    std.tqdm.__init__ = __init__
    try:
        yield
    finally:
        std.tqdm.__init__ = saved


def _clock(seconds_from_now: float) -> str:
    t = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(seconds=seconds_from_now)
    return t.strftime("%H:%M:%S UTC")


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Pace:
    """A tqdm bar over ``total`` steps (on a terminal only) that also logs its pace.

    Lines go to ``file`` (stderr by default, which the workflow sends to the rule's log):
    one after ``first`` timed steps, then at each ``1/reports`` of the run, and one at
    ``close()`` with the whole loop's mean. The bar goes to the same ``file`` and only if
    it is a terminal (a log file gets the plain lines alone). ``disable`` silences both
    (e.g. ranks > 0); ``bar=False`` keeps the lines only (where the loop has a bar of its
    own). ``clock`` is for tests. Use it as a context manager so the summary is written
    even if the loop raises.
    """

    def __init__(self, total: int, desc: str, *, initial: int = 0, first: int = 5,
                 reports: int = 4, disable: bool = False, file: IO[str] | None = None,
                 mininterval: float = 2.0, unit: str = "step", units: str | None = None,
                 bar: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.desc = int(total), desc
        self.unit, self.units = unit, units or unit + "s"
        # Short loops report sooner (a third of the way), so every loop logs a pace line.
        self.first = max(1, min(int(first), (self.total - int(initial)) // 3))
        self.disable = disable
        self.file = file if file is not None else sys.stderr
        self.clock = clock
        # disable=None: tqdm draws the bar only if self.file is a TTY
        self.bar = tqdm(total=total, initial=initial, desc=desc,
                        disable=True if disable or not bar else None,
                        mininterval=mininterval, file=self.file)
        self.n = self._initial = int(initial)
        self._t_start = clock()
        self._t0: float | None = None  # time and count after the first (untimed) step
        self._n0 = 0
        every = max(1, math.ceil(self.total / max(1, int(reports))))
        self._milestones = list(range(every, self.total, every))
        self._first_done = False
        self._closed = False

    def rate(self) -> float | None:
        """Mean seconds per step since the first step (None before two steps)."""
        if self._t0 is None or self.n <= self._n0:
            return None
        return (self.clock() - self._t0) / (self.n - self._n0)

    def message(self) -> str:
        """The pace line for the current step."""
        r = self.rate()
        if r is None:
            return f"{self.desc}: {self.unit} {self.n}/{self.total}"
        left = max(0, self.total - self.n) * r
        return (f"{self.desc}: {self.unit} {self.n}/{self.total}, {r:.3g} s/{self.unit} "
                f"(mean of {self.units} {self._n0 + 1}-{self.n}); {self.total - self.n} left, "
                f"expected finish {_clock(left)} (in {_span(left)})")

    def _write(self, msg: str) -> None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        tqdm.write(f"{stamp} pace {msg}", file=self.file)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)
        if self._t0 is None:
            self._t0, self._n0 = self.clock(), self.n
            return
        if self.disable or self.n >= self.total:
            return
        if not self._first_done:
            if self.n - self._n0 >= self.first:
                self._first_done = True
                self._write(self.message())
                # no milestone line right after the first one
                self._milestones = [m for m in self._milestones if m > self.n + 1]
        elif self._milestones and self.n >= self._milestones[0]:
            self._milestones = [m for m in self._milestones if m > self.n]
            self._write(self.message())

    def set_postfix(self, **kw: Any) -> None:
        self.bar.set_postfix(**kw)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bar.close()
        if self.disable:
            return
        done = self.n - self._initial
        took = self.clock() - self._t_start
        r = self.rate()
        tail = f", {r:.3g} s/{self.unit} after the first" if r is not None else ""
        self._write(f"{self.desc}: {done} {self.unit if done == 1 else self.units} in "
                    f"{_span(took)}{tail}")

    def __enter__(self) -> "Pace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Pace", "bars_only_on_terminal", "on_terminal"]
