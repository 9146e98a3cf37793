"""4-bit floating-point block formats beyond the paper: MXFP4 (OCP MX v1.0) and NVFP4 (NVIDIA).

Both store E2M1 elements (1 sign, 2 exponent, 1 mantissa bit; magnitudes 0, ½, 1, 1½, 2, 3, 4, 6)
in blocks along the reduction (last) axis, each block with one shared scale:

- **MXFP4**: blocks of 32, scale an E8M0 power of two. OCP MX spec v1.0 §6.3: X = 2^(⌊log₂ amax⌋ − 2),
  where 2 = the exponent of E2M1's largest normal (6 = 1.5·2²); the exponent is clamped to E8M0's
  [−127, 127]. Elements are V/X rounded to nearest-even on the E2M1 grid and saturated at ±6 (the spec
  says values above the largest normal after scaling are clamped, so amax/X ∈ [4, 8) may clip).
- **NVFP4**: blocks of 16, scale an FP8 E4M3 number, times one fp32 per-tensor scale. NVIDIA's recipe
  (the NVFP4 blog, TensorRT Model Optimizer, torchao `NVFP4Tensor`, "Pretraining LLMs with NVFP4"
  arXiv 2509.25149 App.): per-tensor decode scale s = amax_tensor/(6·448); block scale
  E = e4m3(amax_block/6 / s), round-to-nearest-even, saturated at 448; element = e2m1(V / (E·s)).
  A block whose E underflows to 0 dequantizes to 0.

Dequantized value = element · scale, with scale = X (MX) or E·s (NV). Everything here is fake
quantization in fp32: no bit packing, no swizzled scale layouts, no stochastic rounding, no
random Hadamard transforms or 2-D weight blocks of the NVFP4 training recipe, and no MSE scale search.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # non-negative magnitudes
MX_BLOCK = 32
NV_BLOCK = 16
_E2M1_EMAX = 2  # exponent of E2M1's largest normal: 6 = 1.5 · 2²
_E8M0_EMIN, _E8M0_EMAX = -127, 127


def e2m1_round(y: Tensor) -> Tensor:
    """Nearest E2M1 value, ties to even mantissa, saturating at ±6.

    E2M1 is uniform with spacing ½ on [0, 2], 1 on [2, 4] and 2 on [4, 6]; within each binade torch's
    half-to-even rounding of y/spacing picks the even mantissa, which is what IEEE RNE does.
    """
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign((a / step).round().mul(step).clamp(max=E2M1_MAX), y)


def mx_scale(amax: Tensor) -> Tensor:
    """E8M0 shared scale of MX blocks with absolute maxima `amax`: 2^(⌊log₂ amax⌋ − 2), clamped."""
    # frexp gives amax = m·2^e with m ∈ [½, 1), so ⌊log₂ amax⌋ = e − 1 exactly (no float log error).
    _, e = torch.frexp(amax)
    exp = torch.where(amax > 0, e - 1 - _E2M1_EMAX, _E8M0_EMIN).clamp(_E8M0_EMIN, _E8M0_EMAX)
    return torch.ldexp(torch.ones_like(amax), exp)


def nv_tensor_scale(amax_tensor: Tensor) -> Tensor:
    """NVFP4 fp32 per-tensor decode scale amax/(6·448), so the largest block scale lands on 448."""
    s = amax_tensor.float() / (E2M1_MAX * E4M3_MAX)
    return torch.where(s > 0, s, torch.ones_like(s))


def nv_block_scale(amax_block: Tensor, tensor_scale: Tensor) -> Tensor:
    """NVFP4 E4M3 block scale (as fp32) for block maxima `amax_block` under a per-tensor scale: the nearest FP8
    E4M3 (OCP "fn" variant) value, ties to even, saturated at ±448."""
    return (amax_block / E2M1_MAX / tensor_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp4_params(x: Tensor, fmt: str, amax_tensor: Tensor | None = None) -> Tensor:
    """The effective scale (…, 1) of each row of x (…, block) for `fmt` "mxfp4" or "nvfp4".

    For NVFP4, `amax_tensor` is the absolute maximum of the whole tensor the rows come from.
    """
    amax = x.abs().amax(-1, keepdim=True)
    if fmt == "mxfp4":
        return mx_scale(amax)
    if amax_tensor is None:
        amax_tensor = amax.amax()
    s = nv_tensor_scale(amax_tensor)
    return nv_block_scale(amax, s) * s


def fp4_round(x: Tensor, scale: Tensor) -> Tensor:
    """Dequantized E2M1 value of x under `scale`; a zero scale (underflowed block) gives 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, e2m1_round(x / safe) * safe, torch.zeros_like(x))
