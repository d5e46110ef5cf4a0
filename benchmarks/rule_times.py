"""Per-rule wall times of a finished run, from Snakemake's `benchmark:` files.

    python benchmarks/rule_times.py [WORKDIR]      (default: the current folder)

Prints, per rule, the number of jobs and the total / mean / max seconds (and max RSS).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def rule_times(workdir: Path) -> pd.DataFrame:
    rows = []
    for tsv in sorted((workdir / "benchmarks" / "out").rglob("*.tsv")):
        rule = tsv.relative_to(workdir / "benchmarks" / "out").parts[0].removesuffix(".tsv")
        df = pd.read_csv(tsv, sep="\t")
        rows.append({"rule": rule, "s": float(df["s"].iloc[-1]),
                     "max_rss_mb": float(pd.to_numeric(df["max_rss"], errors="coerce").iloc[-1])})
    t = pd.DataFrame(rows)
    out = t.groupby("rule").agg(jobs=("s", "size"), total_s=("s", "sum"), mean_s=("s", "mean"),
                                max_s=("s", "max"), max_rss_mb=("max_rss_mb", "max"))
    return out.sort_values("total_s", ascending=False).round(1)


if __name__ == "__main__":
    wd = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    table = rule_times(wd)
    print(table.to_string())
    print(f"\nsum of job times: {table['total_s'].sum():.0f} s")
