"""Which float precision a training or scoring step runs in: the names and the rule for auto.

``bf16`` means autocast: matmuls run in bfloat16 while the weights, the optimiser state and
the loss stay float32 (the usual mixed-precision recipe).
"""

from __future__ import annotations

import warnings

from clusterft.pipeline import hardware
from clusterft.pipeline.errors import InputError

PRECISIONS = ("auto", "bf16", "fp32")


def native_bf16(device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively (CUDA with bf16, or a CPU with
    AVX512-BF16 or AMX, not capped below them: `clusterft.pipeline.hardware`); elsewhere bf16
    autocast is emulated and slower than fp32."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        known = hardware.native_bf16_cpu()
        if known is not None:
            return known
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, f, lambda: False)()) for f in probes)
    return False


def resolve_precision(precision: str, device, field: str = "precision") -> str:
    """``auto`` -> ``bf16`` on a CUDA device with bf16, else ``fp32``; checks the name.

    ``auto`` keeps fp32 on every CPU: emulated bf16 (CPUs without AVX512-BF16/AMX) is far
    slower than fp32, native bf16 pays off only for some shapes (oneDNN builds its kernels
    per matrix shape), and a default in bf16 on some CPUs and fp32 on others would add a
    precision difference to the float-kernel differences machines already have. An explicit
    ``bf16`` on a CPU that emulates it warns (on stderr, so in the rule's log) and runs as
    asked.
    """
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision '{precision}' ({'|'.join(PRECISIONS)})", field=field)
    import torch

    device = torch.device(device)
    if precision == "auto":
        return "bf16" if device.type == "cuda" and native_bf16(device) else "fp32"
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        warnings.warn(hardware.emulated_bf16_message(field), stacklevel=2)
    return precision


def autocast(device, precision: str):
    """The autocast context of a resolved precision (a no-op context for fp32)."""
    import torch

    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def base_dtype(precision: str, device, finetune: str):
    """The dtype a model's weights are loaded in, for a resolved ``precision``.

    LoRA on a CUDA device in bf16 keeps the frozen base in bfloat16: its weights take no
    gradient and no optimiser state, so nothing needs float32 masters, and a 13B base takes
    26 GB instead of 52 GB per rank (peft keeps the adapters in float32). Everything else
    loads float32: full fine-tuning updates the weights themselves (bf16 weights would lose
    small updates), and on a CPU bf16 is autocast over float32 weights as before.
    """
    import torch

    if precision == "bf16" and finetune == "lora" and torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.float32
