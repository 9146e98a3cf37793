"""Round-to-nearest (RTN) fake quantization: scales, grids, granularity. Pure functions on tensors.

The paper (arXiv 2509.23500, paper.md §5) quantizes weights and activations to 4 bits with symmetric
AbsMax RTN, one scale per row: per output channel for a weight (out, in), per token for an activation
(…, in). The exact integer grid is not stated, so it is a setting (`grid`):

| grid   | levels q               | step Δ, zero point z                                     | 4-bit    |
|--------|------------------------|----------------------------------------------------------|----------|
| "sym"  | −(2^{b−1}−1)…2^{b−1}−1 | Δ = absmax/(2^{b−1}−1), z = 0                            | [−7, 7]  |
| "sym8" | −2^{b−1}…2^{b−1}−1     | Δ = −x_ext/2^{b−1}, z = 0; x_ext = entry of max |x|      | [−8, 7]  |
| "full" | −2^{b−1}…2^{b−1}−1     | Δ = absmax/(2^{b−1}−½), z = 0                            | [−8, 7]  |
| "odd"  | −2^{b−1}+1…2^{b−1}     | Δ = 2(absmax + 1e−8)/(2^b−1), z = ½                      | ±½…±7½ Δ |
| "asym" | 0…2^b−1                | Δ = (hi−lo)/(2^b−1), lo/hi = min(x,0)/max(x,0), z = round(−lo/Δ) | 0…15 |

and every grid dequantizes as x̂ = (clamp(round(x/Δ + z), q_min, q_max) − z)·Δ.
- "sym" is the default: QuaRot's grid, the paper's reading (a) (paper.md §5).
- "odd" is the authors' `UniformQuantizer` (paper.md §5 (b)): x̂ = (round(clip(x,−s,s)/Δ + ½) − ½)·Δ with
  s = absmax + 1e−8: 2^b levels at odd multiples of Δ/2 and no zero.
- "sym8" follows llama.cpp's Q4_0: the extreme entry lands exactly on −2^{b−1} (the scale takes its
  sign), so all 2^b levels are used and the opposite side reaches 7/8 of the extreme. The literal
  reading "Δ = absmax/7, clamp to [−8, 7]" never reaches −8 without clipping, so it would equal "sym".
- "full" is llm-compressor's (compressed-tensors `calculate_qparams`: Δ = absmax/((q_max−q_min)/2)) and
  torchao's (`choose_qparams_affine`, MappingType.SYMMETRIC) symmetric int: ±absmax map to ±7.5 (4-bit), so
  all 16 levels are in reach and +absmax clips to 7 with error Δ/2, no more than rounding's anywhere. For
  comparing with them like with like; torchao multiplies by 1/Δ where we (and compressed-tensors) divide.

Granularity (the last axis is always the reduction / input-feature axis):
"tensor" one scale; "channel" / "token" one scale per row of the last axis (a weight's output channel, an
activation's token: the same operation, two names); "group" one scale per `group_size` consecutive
entries of a row (a short last group is zero-padded, which never changes a scale since every grid
contains 0 in its range). Formats "mxfp4"/"nvfp4" (formats.py) use their fixed blocks of 32/16 instead.

Left out on purpose: clipping-ratio / MSE scale search, static activation scales, bit packing and
integer kernels (everything is dequantized "fake" quantization, in fp64 for fp64 inputs and else fp32; the
NVFP4 per-tensor scale is fp32 by definition), straight-through gradients
(QAT wraps these functions, see qat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from optquant.errors import OptquantError
from optquant.quant import formats
from optquant.quant.choices import FORMATS, GRIDS, Format, Grid

Granularity = Literal["tensor", "channel", "token", "group"]
GRANULARITIES: tuple[str, ...] = ("tensor", "channel", "token", "group")
OFF = 16  # a PTQ / QAT w_bits or a_bits of 16 means "not quantized"


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized. `grid`, `granularity` and `group_size` apply to format "int" only."""

    bits: int = 4
    grid: Grid = "sym"
    granularity: Granularity = "channel"
    group_size: int = 128  # entries per scale along the last axis, for granularity "group"
    format: Format = "int"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise OptquantError(f"quant format must be one of {FORMATS}, got {self.format!r}")
        if self.format != "int" and self.bits != 4:
            raise OptquantError(f"format {self.format} has 4-bit elements, got bits={self.bits}")
        if not 2 <= self.bits <= 16:
            raise OptquantError(f"quant bits must be in [2, 16], got {self.bits}")
        if self.grid not in GRIDS:
            raise OptquantError(f"quant grid must be one of {GRIDS}, got {self.grid!r}")
        if self.granularity not in GRANULARITIES:
            raise OptquantError(f"quant granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity == "group" and self.group_size < 1:
            raise OptquantError(f"quant group_size must be >= 1, got {self.group_size}")

    @property
    def block(self) -> int:
        """Entries sharing one scale along the last axis: g > 0, 0 = a whole row, −1 = the whole tensor."""
        if self.format == "mxfp4":
            return formats.MX_BLOCK
        if self.format == "nvfp4":
            return formats.NV_BLOCK
        return {"tensor": -1, "group": self.group_size}.get(self.granularity, 0)


def grid_range(bits: int, grid: str) -> tuple[int, int]:
    """(q_min, q_max) of an integer grid; see the table in the module docstring."""
    half = 2 ** (bits - 1)
    return {"sym": (1 - half, half - 1), "sym8": (-half, half - 1), "full": (-half, half - 1),
            "odd": (1 - half, half)}.get(grid, (0, 2**bits - 1))


def int_params(x: Tensor, bits: int, grid: str) -> tuple[Tensor, Tensor]:
    """Step Δ and zero point z (each (…, 1)) of each row of x (…, k) over its last axis.

    An all-zero row gets Δ = 1 (its entries quantize to 0 on every grid).
    """
    absmax, lo = x.abs().amax(-1, keepdim=True), None
    if grid == "sym":
        scale = absmax / (2 ** (bits - 1) - 1)
    elif grid == "sym8":
        scale = -x.gather(-1, x.abs().argmax(-1, keepdim=True)) / 2 ** (bits - 1)
    elif grid == "full":
        scale = absmax / (2 ** (bits - 1) - 0.5)
    elif grid == "odd":
        return 2 * (absmax + 1e-8) / (2**bits - 1), torch.full_like(absmax, 0.5)
    else:
        lo = x.amin(-1, keepdim=True).clamp(max=0)
        hi = x.amax(-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / (2**bits - 1)
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))
    return scale, torch.zeros_like(scale) if lo is None else (-lo / scale).round()


def quant_params(x: Tensor, spec: QuantSpec, amax_tensor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Scale and zero point (each (…, 1)) for each row of x (…, k), one row = one scale group.

    GPTQ calls this on column groups of a weight; `amax_tensor` is the whole tensor's absolute maximum
    (only NVFP4 uses it; default: the maximum over x).
    """
    if spec.format == "int":
        return int_params(x, spec.bits, spec.grid)
    scale = formats.fp4_params(x, spec.format, amax_tensor)
    return scale, torch.zeros_like(scale)


def round_to_grid(x: Tensor, scale: Tensor, zero: Tensor, spec: QuantSpec) -> Tensor:
    """Dequantized RTN value of x under (scale, zero), which broadcast against x."""
    if spec.format != "int":
        return formats.fp4_round(x, scale)
    q_min, q_max = grid_range(spec.bits, spec.grid)
    return ((x / scale + zero).round().clamp(q_min, q_max) - zero) * scale


def group_rows(x: Tensor, block: int) -> Tensor:
    """View x as rows of one scale group each: (1, numel) for block −1, (rows, k) for 0, else
    (rows·⌈k/block⌉, block) with the last axis zero-padded to a multiple of `block`."""
    if block == -1:
        return x.reshape(1, -1)
    k = x.shape[-1]
    x = x.reshape(-1, k)
    if block == 0:
        return x
    return F.pad(x, (0, -k % block)).reshape(-1, block)


def fake_quant(x: Tensor, spec: QuantSpec) -> Tensor:
    """Quantize and dequantize x (…, k) with `spec`; same shape and dtype as x, computed in x's dtype if fp32 or
    fp64 (an fp64 analysis stays fp64), else in fp32."""
    if x.dim() == 0 or x.numel() == 0:
        raise OptquantError(f"fake_quant needs a non-empty tensor with an axis, got {tuple(x.shape)}")
    xf = x if x.dtype == torch.float64 else x.float()
    k = x.shape[-1]
    rows = group_rows(xf, spec.block)
    amax = xf.abs().amax() if spec.format == "nvfp4" else None
    out = round_to_grid(rows, *quant_params(rows, spec, amax), spec)
    if spec.block > 0:
        out = out.reshape(-1, k + (-k % spec.block))[:, :k]
    return out.reshape(x.shape).to(x.dtype)
