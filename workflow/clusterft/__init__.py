"""cluster-ft: gradient-clustered data selection and cluster-balanced data-parallel fine-tuning."""

__version__ = "0.1.0"
