"""Snakemake wrapper: check one pool against every benchmark task; drop or flag overlaps."""
import sys

from clusterft.stages.data.decontaminate import run_decontaminate
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.smk import logged

try:
    with logged(snakemake.log[0]):
        run_decontaminate(
            snakemake.wildcards.dataset,
            snakemake.input.pool,
            list(snakemake.input.task_items),
            snakemake.params.cfg,
            out_pool=snakemake.output.pool,
            out_counts=snakemake.output.counts,
        )
except InputError as e:  # on the terminal too, not only in the log
    print(f"decontaminate: {e}", file=sys.stderr)
    raise
