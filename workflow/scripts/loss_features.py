"""Snakemake wrapper: loss-trajectory features (S2L) from a score run."""
from clusterft.pipeline.smk import logged
from clusterft.stages.features.trajectories import run_loss_features

with logged(snakemake.log[0]):
    run_loss_features(
        snakemake.input.trajectories,
        snakemake.input.scores,
        snakemake.output.features,
        snakemake.output.scores,
    )
