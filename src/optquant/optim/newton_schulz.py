"""The quintic Newton–Schulz iteration of Muon and Scion, in a chosen dtype.

`torch.optim.Muon` and `pytorch_optimizer.SCION` both hard-code bf16 for it (KellerJordan/Muon's choice,
made for GPUs). On a CPU without native bf16 that is emulated and far slower than fp32 (docs/benchmarks.md), so both
optimizers here call this one function with `dtype` from their `ns_dtype` setting (`device.use_bf16`
decides `auto`). In bf16 it performs the libraries' operations in their order, so its result is bitwise
theirs (tests/test_optim.py holds that against both libraries); in fp32 it is the same iteration with
less rounding. The iteration (paper.md §3): X = G/max(‖G‖_F, ε) on the wide side (rows ≤ columns),
then `steps` times A = XXᵀ, X ← aX + (bA + cA²)X with (a, b, c) = (3.4445, −4.7750, 2.0315).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from optquant.device import use_bf16
from optquant.errors import OptquantError

NS5_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # KellerJordan/Muon's quintic
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(
    g: Tensor, steps: int, dtype: torch.dtype, coefficients: tuple[float, float, float] = NS5_COEFFICIENTS,
    eps: float = 1e-7, memory_format: torch.memory_format = torch.preserve_format,
) -> Tensor:
    """≈ UVᵀ of G = USVᵀ (singular values mapped into about [0.7, 1.2]), for a matrix or a stack of them;
    returned in `dtype`. A tall G is iterated as Gᵀ; `memory_format` is that transposed copy's layout:
    torch's Muon keeps it a strided view (`preserve_format`), the library's SCION makes it contiguous,
    and in bf16 the two round XXᵀ differently on rare inputs."""
    if g.ndim not in (2, 3):
        raise ValueError(f"Newton–Schulz takes a matrix or a stack of matrices, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = (g.mT if tall else g).to(dtype=dtype, copy=True, memory_format=memory_format)
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp_(min=eps))
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if tall else x


def newton_schulz_many(mats: list[Tensor], steps: int, dtype: torch.dtype, **kwargs) -> list[Tensor]:
    """`newton_schulz` of each matrix, matrices of one shape stacked into one call (on small CPU models
    the per-call overhead is most of the cost); the same values as one call per matrix."""
    same: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        same[(m.device, m.dtype, m.shape)].append(i)
    out: list[Tensor] = list(mats)
    for idx in same.values():
        x = newton_schulz(mats[idx[0]] if len(idx) == 1 else torch.stack([mats[i] for i in idx]), steps, dtype,
                          **kwargs)
        for i, o in zip(idx, [x] if len(idx) == 1 else x.unbind(), strict=True):
            out[i] = o
    return out


def resolve_ns_dtype(setting: str, params: list[Tensor]) -> str:
    """"bf16" or "fp32" for a config's `ns_dtype` ("auto": bf16 where `params`' device multiplies bf16
    natively, the rule of `train.precision=auto`)."""
    if setting not in ("auto", *DTYPES):
        raise OptquantError(f"ns_dtype must be auto, bf16 or fp32, got {setting!r}")
    device = params[0].device if params else torch.device("cpu")
    return "bf16" if use_bf16(setting, device) else "fp32"


def set_ns_dtype_(opt: torch.optim.Optimizer, ns_dtype: str) -> None:
    """Make `ns_dtype` ("bf16" or "fp32") the optimizer's default and that of every group without its own."""
    if ns_dtype not in DTYPES:
        raise OptquantError(f"{type(opt).__name__} ns_dtype must be bf16 or fp32, got {ns_dtype!r}")
    opt.defaults["ns_dtype"] = ns_dtype
    for group in opt.param_groups:
        group.setdefault("ns_dtype", ns_dtype)
