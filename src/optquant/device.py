"""Which precision a device computes fast: one rule for the model's autocast and the optimizers' matmuls.

bf16 pays only where the hardware multiplies bf16 natively: CUDA devices that support it, and CPUs with
AVX512-BF16 or AMX. Elsewhere (e.g. AVX2-only CPUs) torch emulates bf16 matmuls, many times slower than
fp32 (docs/benchmarks.md), so `auto` means fp32 there. `train.precision` and Muon's/Scion's
`ns_dtype` both go through `use_bf16`.

`keep_freed_memory` / `return_freed_memory` are the other machine fact: how glibc's malloc returns memory to the
kernel.
`resident(module)` holds a lazily loaded module's weights in memory for a block (optquant.hf.lazy).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo() -> list[str]:
    """The lines of /proc/cpuinfo (none where there is no such file)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo."""
    return {flag for line in _cpuinfo() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def fast_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively (CUDA bf16, AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def use_bf16(precision: str, device: torch.device) -> bool:
    """`bf16` → True, `fp32` → False, `auto` → bf16 where the hardware has fast bf16 matmuls."""
    return fast_bf16(device) if precision == "auto" else precision == "bf16"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc's malloc.h
KEEP_BYTES = 1 << 30
RETURN_BYTES = 1 << 20


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks of up to 1 GiB for reuse instead of handing them back to the
    kernel. By default glibc maps big blocks afresh (mmap) and trims the heap's free top, so a tensor of a
    few MB (at `pico`, the 1024×1024 logits and their gradients) can cost page faults on every step; kept,
    the same blocks are reused, which saves most of a study's system time (docs/benchmarks.md: per step with
    benchmarks/allocator.py, a whole run, a whole study). Numbers are unchanged: only where the memory comes
    from differs. The cost is resident memory: a process keeps its peak. Not touched when the user tunes malloc already
    (GLIBC_TUNABLES naming glibc.malloc, or MALLOC_*_ variables), nor off glibc. Returns whether it applied."""
    return _mallopt(KEEP_BYTES)


def return_freed_memory() -> bool:
    """The opposite, for the runs memory bounds (`--hf`): every block of 1 MiB or more mapped on its own and
    unmapped when freed, the heap trimmed above 1 MiB free. glibc's default raises its mmap threshold to the
    largest block freed (up to 32 MiB), after which a walk's activations of a few MB land on the heap, and the
    heap's holes stay resident (a 2-layer 0.5B-shaped bf16 analyze peaked 0.19 GB lower with the threshold
    pinned, docs/benchmarks.md). The cost is page faults on each big allocation. Same conditions and return as
    keep_freed_memory."""
    return _mallopt(RETURN_BYTES)


def _mallopt(size: int) -> bool:
    if not sys.platform.startswith("linux") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, size) and libc.mallopt(M_TRIM_THRESHOLD, size))
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False


@contextlib.contextmanager
def resident(module: torch.nn.Module, device: torch.device | None = None) -> Iterator[torch.nn.Module]:
    """`module` with its weights in memory for the block: a lazily loaded one (a `_lazy_weights` handle with
    load_/release_, optquant.hf.lazy) is read onto `device` now and released after; any other is a no-op."""
    lazy = getattr(module, "_lazy_weights", None)
    if lazy is None:
        yield module
        return
    lazy.load_(module, device or torch.device("cpu"))
    try:
        yield module
    finally:
        lazy.release_(module)
