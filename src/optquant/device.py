"""Which precision a device computes fast: one rule for the model's autocast and the optimizers' matmuls.

bf16 pays only where the hardware multiplies bf16 natively: CUDA devices that support it, and CPUs with
AVX512-BF16 or AMX. Elsewhere (e.g. AVX2-only CPUs) torch emulates bf16 matmuls, measured ~47× slower
than fp32 on a 512×2048×512 product, so `auto` means fp32 there. `train.precision` and Muon's/Scion's
`ns_dtype` both go through `use_bf16`.
"""

from __future__ import annotations

from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def fast_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively (CUDA bf16, AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def use_bf16(precision: str, device: torch.device) -> bool:
    """`bf16` → True, `fp32` → False, `auto` → bf16 where the hardware has fast bf16 matmuls."""
    if precision != "auto":
        return precision == "bf16"
    return fast_bf16(device)
