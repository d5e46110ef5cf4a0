"""Process-level settings shared by the entry points (CLI, torchrun ranks, Snakemake scripts)."""

from __future__ import annotations

import gc


def freeze_for_exit() -> None:
    """Skip the garbage collector's passes over everything loaded when the process ends.

    With torch + transformers (+ lm-eval) imported and a model loaded, Python's shutdown
    spends a second or more in the collector's final passes, once per process: per training
    rank, evaluation and scoring job (benchmarks/bench_job_overhead.py measures it).
    ``gc.freeze()`` moves every live object out of the collector's reach; the process then
    exits normally (atexit handlers run, files are flushed and closed), much sooner. Call it
    when the work is done.
    """
    gc.freeze()


def end_rank(code: int = 0) -> None:
    """End a rank of a multi-rank (torchrun) job now, once its work is written and its
    process group destroyed: flush the streams and logging, then ``os._exit``.

    The process group's C++ threads (gloo's) can otherwise race the interpreter's shutdown
    and the static destructors: now and then a rank whose work was done died with SIGABRT
    ("terminate called without an active exception"), and torchrun failed a finished job
    (once in a SLURM smoke run; the same race as pytorch/pytorch#179291 describes). A
    single-process run returns normally (the caller's ``sys.exit``)."""
    import logging
    import os
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
