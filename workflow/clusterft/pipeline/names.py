"""Names that appear in run paths, configs and tables, written once: the selection methods,
the feature kinds they cluster, and the ways of dealing the data over the GPUs. Stages, the
workflow and the CLI import them from here (no torch: the Snakefile imports this at parse
time)."""

from __future__ import annotations

# Selection methods:
# - full: the whole pool; random: a uniform random subset;
# - cluster: the method (per-cluster quotas on clusters of gradient features);
# - embed-cluster, tfidf-cluster: the same quotas on clusters of other features (do
#   gradients find the skills better than the model's embeddings or the words do?);
# - s2l: S2L (Yang et al. 2024): clusters of loss trajectories, smallest cluster first;
# - oracle: the same quotas on the TRUE labels (a reference for what perfect skill
#   recovery would buy, never a contender: it reads labels no method can see).
# - rs2: RS2 (Okanovic et al. 2023): a fresh uniform random subset of the budget's size every
#   epoch (same steps as the other runs at that budget, more distinct examples seen).
# - less: LESS (Xia et al. 2024): top-k by the gradient features' similarity to each
#   benchmark task's validation examples (max over tasks);
# - rds: RDS+ (Ivison et al. 2025): the same target-aware rule on embedding features,
#   round-robin over the tasks.
METHODS = ("full", "random", "cluster", "embed-cluster", "tfidf-cluster", "s2l", "oracle", "rs2",
           "less", "rds")
(FULL, RANDOM, CLUSTER, EMBED_CLUSTER, TFIDF_CLUSTER, S2L, ORACLE, RS2, LESS,
 RDS) = METHODS
# Methods that read the benchmark tasks' validation examples (target-aware selection).
TARGET_AWARE = (LESS, RDS)
# Reference selections that may read the true labels: reported, never ranked as methods.
REFERENCES = (ORACLE,)
# The base model evaluated without fine-tuning (a run of its own in paths and tables).
BASE = "base"

# Features the cluster stage runs on: per-example gradients (score), the base model's mean
# last hidden state, TF-IDF of the text, and warm-up loss trajectories (S2L's proxy signal).
FEATURE_KINDS = ("gradient", "embedding", "tfidf", "loss")
GRADIENT, EMBEDDING, TFIDF, LOSS = FEATURE_KINDS
# The features each method selects with (full, random, oracle and rs2 read the gradient
# run's ids only; less and rds read the features themselves and their targets').
FEATURES_OF = {CLUSTER: GRADIENT, EMBED_CLUSTER: EMBEDDING, TFIDF_CLUSTER: TFIDF, S2L: LOSS,
               LESS: GRADIENT, RDS: EMBEDDING}


def features_of(method: str) -> str:
    """The feature kind whose clusters (and ids) ``method`` reads."""
    return FEATURES_OF.get(method, GRADIENT)


# How the selected data is dealt over the ranks: torch's DistributedSampler, or
# clusterft.sampler.ClusterBalancedSampler.
DISTRIBUTIONS = ("random", "balanced")
RANDOM_SPLIT, BALANCED = DISTRIBUTIONS

# The step-matched arm (sweep.step_matched): a run trained with train.step_budget pool, as
# many optimiser steps as full data takes, carries this suffix on its distribution in paths
# (g1-balanced_steps): the same selection and deal, only the steps differ.
STEPS_SUFFIX = "_steps"
# How the step-matched arm's runs are named in tables and comparisons.
STEPS_LABEL = " [full's steps]"
DIST_PATTERN = "(" + "|".join(DISTRIBUTIONS) + ")(" + STEPS_SUFFIX + ")?"


def split_dist(dist: str) -> tuple[str, bool]:
    """A run's path distribution as (the distribution, whether it is step-matched)."""
    if dist.endswith(STEPS_SUFFIX):
        return dist[: -len(STEPS_SUFFIX)], True
    return dist, False
