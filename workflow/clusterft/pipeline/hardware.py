"""What this machine's CPU can do, read without importing torch (the config check runs when
Snakemake parses the workflow, where importing torch would cost seconds).

bf16 autocast is fast on a CPU only where it computes bfloat16 natively (AVX512-BF16 or AMX
on x86, the BF16 extension on Arm); elsewhere oneDNN emulates it, many times slower than
fp32 (docs/cpus_and_precision.md). ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` cap the kernels torch may use: a CPU
with native bf16 run under ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` takes the
same kernels as one without, so it counts as non-native here too.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Mapping

# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) below the first one with bf16 instructions.
ONEDNN_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})
# ATen CPU capabilities (ATEN_CPU_CAPABILITY) that run bf16 elementwise kernels emulated
# (oneDNN's matmuls may still be native: counted as non-native to be on the safe side).
ATEN_CAPS_WITHOUT_BF16 = frozenset({"default", "avx2"})
# /proc/cpuinfo flags (x86) / features (Arm) of native bfloat16 arithmetic.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as {key: value} (empty where unreadable)."""
    out: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip().lower(), value.strip())
    return out


def cpu_flags(info: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """Instruction-set flags of the CPU; None where the OS does not list them."""
    info = _cpuinfo() if info is None else info
    raw = info.get("flags") or info.get("features")
    return frozenset(raw.split()) if raw else None


def cpu_model(info: Mapping[str, str] | None = None) -> str:
    info = _cpuinfo() if info is None else info
    return (info.get("model name") or info.get("cpu model") or platform.processor()
            or platform.machine() or "unknown CPU")


def cpu_vendor(info: Mapping[str, str] | None = None) -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...); empty where not listed."""
    info = _cpuinfo() if info is None else info
    return info.get("vendor_id", "")


def machine() -> str:
    """The machine's architecture as Python names it (x86_64, aarch64, ...)."""
    return platform.machine()


def isa_cap(env: Mapping[str, str] | None = None) -> str | None:
    """The environment variable that keeps torch off native bf16 kernels, if one is set."""
    env = os.environ if env is None else env
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # the second is the old name
        isa = env.get(var, "").strip().upper()
        if isa in ONEDNN_ISAS_WITHOUT_BF16:
            return f"{var}={isa}"
    cap = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap in ATEN_CAPS_WITHOUT_BF16:
        return f"ATEN_CPU_CAPABILITY={cap}"
    return None


def native_bf16_cpu(flags: frozenset[str] | None = None,
                    env: Mapping[str, str] | None = None) -> bool | None:
    """True/False where the CPU flags are known; None where they are not (ask torch)."""
    if isa_cap(env) is not None:
        return False
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return None
    return bool(flags & BF16_FLAGS)


def cuda_visible() -> bool:
    """Whether an NVIDIA driver is visible on this node (no torch import)."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def emulated_bf16_message(field: str) -> str:
    """What to tell a user whose ``field`` asks for bf16 on a CPU that emulates it."""
    why = isa_cap() or "no AVX512-BF16 or AMX"
    return (f"{field}: bf16 on a CPU that emulates bfloat16 ({why}): expect steps many "
            f"times slower than fp32 (benchmarks/README.md). Set {field} to fp32 (or auto, which is fp32 on every CPU).")


def describe() -> dict[str, object]:
    """The CPU facts a timing depends on, for metrics files and the report."""
    info = _cpuinfo()
    flags = cpu_flags(info) or frozenset()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(info), "cores": cores,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "avx2": "avx2" in flags, "isa_cap": isa_cap(), "native_bf16": native_bf16_cpu()}


__all__ = ["cpu_flags", "cpu_model", "cpu_vendor", "machine", "isa_cap", "native_bf16_cpu", "cuda_visible",
           "emulated_bf16_message", "describe"]
