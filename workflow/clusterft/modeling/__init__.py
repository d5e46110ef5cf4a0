"""Model plumbing shared by the stages that load, train or score a model: HF folders,
tokenisation and the prompt format, LoRA, precision, the optimiser, micro-batching,
the process group, checkpoints and the base models' pretraining loop."""
