"""Glue every layer may use: user errors, atomic I/O, the names written once, config
sections, provenance sidecars, progress lines, process settings, the CPU's abilities, the
train-job launcher and the Snakemake script wrapper. Imports nothing else of the package."""
