"""Orthonormal Walsh–Hadamard matrices, whole or block-diagonal.

Sylvester construction for powers of two; for other sizes a block-diagonal matrix of the largest
power-of-two block that divides n (QuaRot and QuEST use the same trick). A dense matmul with a
precomputed H is faster on CPU than a Python-loop butterfly at the sizes used here
(dependencies.md §2), so that is what callers do.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor


def largest_pow2_divisor(n: int, cap: int | None = None) -> int:
    b = n & -n
    return min(b, cap) if cap else b


@functools.lru_cache(maxsize=32)
def _hadamard64(n: int) -> Tensor:
    from scipy.linalg import hadamard as sylvester  # [[H, H], [H, −H]]; a ValueError unless n is a power of two

    return torch.from_numpy(sylvester(n, dtype=np.float64)) / n**0.5


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Orthonormal n×n Hadamard (H Hᵀ = I); n a power of two."""
    return _hadamard64(n).to(dtype)


@functools.lru_cache(maxsize=32)
def _hadamard_on(block: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return hadamard(block, dtype).to(device)  # rounded from fp64 per dtype: never a buffer .double() spoils


def rotate_blocks(x: Tensor, block: int) -> Tensor:
    """x·blockdiag(H_b, …, H_b) along the last axis (orthonormal Hadamard blocks of size b), one dense matmul;
    QuEST's rotation in QAT (quant/qat.py). rotate.py's OnlineHadamard factors larger blocks instead."""
    H = _hadamard_on(block, x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], -1, block) @ H).reshape(x.shape)


def block_hadamard(n: int, block: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Block-diagonal orthonormal Hadamard of size n with blocks of `block` (default: the largest
    power of two dividing n). Orthonormal for every n."""
    block = block or largest_pow2_divisor(n)
    if n % block:
        raise ValueError(f"block {block} does not divide {n}")
    return torch.block_diag(*[hadamard(block, torch.float64)] * (n // block)).to(dtype)
