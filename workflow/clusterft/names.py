"""Names that appear in run paths, configs and tables, written once: the selection methods
and the ways of dealing the data over the GPUs. Stages, the workflow and the CLI import
them from here (no torch: the Snakefile imports this at parse time)."""

from __future__ import annotations

# Selection methods: the whole pool, a random subset, gradient-cluster selection.
METHODS = ("full", "random", "cluster")
FULL, RANDOM, CLUSTER = METHODS
# The base model evaluated without fine-tuning (a run of its own in paths and tables).
BASE = "base"
# How the selected data is dealt over the ranks: torch's DistributedSampler, or
# clusterft.sampler.ClusterBalancedSampler.
DISTRIBUTIONS = ("random", "balanced")
RANDOM_SPLIT, BALANCED = DISTRIBUTIONS
