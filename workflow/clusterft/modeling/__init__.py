"""Model plumbing shared by the stages that load, train or score a model: HF folders (`hf`) and GGUF
checkpoints made into them (`gguf`),
tokenisation (`tokenize`) and the prompt format (`prompt`), LoRA (`lora`), precision
(`precision`), the optimiser (`optim`), micro-batching (`microbatch`), the process group
(`distributed`), checkpoints (`checkpoint`) and the base models' pretraining loop
(`pretrain`). Imports only `pipeline`."""
