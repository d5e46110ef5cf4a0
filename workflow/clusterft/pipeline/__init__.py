"""Glue every layer may use: user errors (`errors`), atomic I/O (`io`), the names written
once (`names`), config sections over DEFAULTS (`sections`), provenance sidecars
(`provenance`), progress lines (`pace`), process settings (`runtime`), the CPU's abilities
(`hardware`), the train-job launcher (`launch`), the Snakemake script wrapper (`smk`) and
feature-row files (`rows`), and files taken out of PyPI packages' wheels into a
cache (`fetch`: the real model, shipped benchmark data). The bottom layer: imports nothing else of the package."""
