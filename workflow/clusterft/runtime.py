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
