"""Glue for the thin Snakemake scripts: log redirection and the package path."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator

from clusterft.pipeline.runtime import freeze_for_exit


@contextlib.contextmanager
def logged(log_path: str | None) -> Iterator[None]:
    """Send stdout, stderr (tqdm bars included) and `logging` of one job to its log file."""
    if not log_path:
        yield
        return
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8", buffering=1) as f:
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = f
        handler = logging.StreamHandler(f)
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            yield
            freeze_for_exit()
        except BaseException:
            import traceback

            traceback.print_exc(file=f)
            raise
        finally:
            sys.stdout, sys.stderr = old_out, old_err
