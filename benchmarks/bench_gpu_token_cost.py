"""Measure the cost model's per-token and per-step costs on a GPU (``clusterft.analysis.costmodel``).

The cost model predicts a training step as ``slowest rank's padded tokens x seconds per
token + a fixed per-step cost``, with a per-token default derived from FLOPs at an assumed
utilisation. This script measures both on the GPU at hand: it builds a Llama with the
layer shapes of a real model (default Llama-2 7B: hidden 4096, MLP 11008, 32 heads, vocab
32000) but only ``--layers`` decoder layers (so it fits next to its activations on one
GPU), wraps it in LoRA exactly as train does (``clusterft.modeling.lora.add_lora``, the repo's
defaults unless changed), and times forward + backward + AdamW steps in bf16 autocast at
several token counts (batch x sequence length). A least-squares line through
(tokens, seconds) gives the per-token slope and the fixed intercept. It repeats that at
two depths and extrapolates linearly to the full model's layer count, so the embedding,
head and per-step fixed costs are not counted once per layer. Last it prints the per-token
cost of the full model, the intercept, the MFU they imply (4 x params FLOPs per token for
LoRA) and the ratio to the cost model's default.

    python benchmarks/bench_gpu_token_cost.py [--layers 2 4] [--full-layers 32]
        [--tokens 4096 8192 16384] [--seq-len 1024] [--repeats 5]

Without a CUDA GPU it prints why and exits 0 (nothing to measure on a CPU: the cost model
is about GPUs). ``--smoke`` runs a tiny model on the CPU in seconds, to check the script
works; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from clusterft.analysis.costmodel import (DEFAULT_MFU, DEFAULT_STEP_OVERHEAD_S,  # noqa: E402
                                 H100_BF16_FLOPS, CostModel)
from clusterft.modeling.lora import DEFAULTS as LORA_DEFAULTS, add_lora  # noqa: E402

SHAPES = {  # Llama-2 layer shapes (the models' config.json)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, full_layers=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                num_key_value_heads=40, vocab_size=32000, full_layers=40),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, full_layers=4),
}


def build(shape: dict, layers: int, seq_len: int, device: str):
    """A Llama of ``shape`` with ``layers`` layers, LoRA-wrapped as train does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k != "full_layers"},
                      num_hidden_layers=layers, max_position_embeddings=seq_len)
    model = LlamaForCausalLM(cfg).to(device)
    model = add_lora(model, dict(LORA_DEFAULTS), "lora", seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    return model, n_params


def time_steps(model, tokens: int, seq_len: int, device: str, repeats: int, bf16: bool) -> float:
    """Median seconds of a forward + backward + AdamW step on ``tokens`` tokens."""
    batch = max(1, tokens // seq_len)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq_len), device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for i in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:  # two warm-up steps (kernel selection, allocator)
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def fit(tokens: list[int], secs: list[float]) -> tuple[float, float]:
    """Least-squares slope (s/token) and intercept (s/step)."""
    slope, icpt = np.polyfit(np.asarray(tokens, float), np.asarray(secs, float), 1)
    return float(slope), float(icpt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_FLOPS,
                    help="the GPU's dense bf16 peak, for the implied MFU (default H100 SXM)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.layers, a.tokens, a.seq_len, a.repeats = "tiny", [1, 2], [64, 128, 256], 64, 2
        device, bf16 = "cpu", False
    elif not torch.cuda.is_available():
        print("skipped: no CUDA GPU here; this script measures the cost model's per-token "
              "cost on a GPU (run it on one; --smoke checks it on the CPU)")
        return 0
    else:
        device, bf16 = "cuda", True
    shape = SHAPES[a.shape]
    print(f"device {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
          + f"; Llama {a.shape} layer shapes, LoRA r={LORA_DEFAULTS['r']}, seq {a.seq_len}")
    per_layer = {}
    for L in a.layers:
        model, n = build(shape, L, a.seq_len, device)
        secs = [time_steps(model, t, a.seq_len, device, a.repeats, bf16) for t in a.tokens]
        slope, icpt = fit(a.tokens, secs)
        per_layer[L] = (slope, icpt, n)
        print(f"  {L} layers ({n / 1e6:.0f}M params): "
              + ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in zip(a.tokens, secs))
              + f" -> {slope * 1e6:.3f} us/token + {icpt * 1e3:.1f} ms/step")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    (l0, (s0, i0, n0)), (l1, (s1, i1, n1)) = sorted(per_layer.items())
    full = shape["full_layers"]
    slope = s0 + (s1 - s0) / (l1 - l0) * (full - l0)
    icpt = i0 + (i1 - i0) / (l1 - l0) * (full - l0)
    params = n0 + (n1 - n0) / (l1 - l0) * (full - l0)
    mfu = 4 * params / slope / a.peak_flops
    default = CostModel.from_params(params, "lora")
    print(f"full model ({full} layers, {params / 1e9:.2f}B params), extrapolated: "
          f"{slope * 1e6:.3f} us/token (cost model default {default.seconds_per_token * 1e6:.3f}, "
          f"MFU {DEFAULT_MFU}), {icpt * 1e3:.1f} ms/step fixed (default "
          f"{DEFAULT_STEP_OVERHEAD_S * 1e3:.0f})")
    print(f"ratios: measured / default per-token cost {slope / default.seconds_per_token:.3f}x; "
          f"implied MFU {mfu:.3f} (4 x params FLOPs per token at {a.peak_flops:.3g} FLOP/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
