"""Quantization-aware training: `prepare_qat_(model, QATConfig())` before training, then train as usual.

The paper (arXiv 2509.23500, paper.md §8) trains W4A4 from scratch with QuEST (Panferov et al. 2025):
every linear layer, the LM head included, computes F.linear(Q_a(xH), Q_w(WH)), H an orthonormal block
Hadamard (blocks of 128, or the largest power of two dividing the input width); (xH)(WH)ᵀ = xWᵀ, so
nothing is rotated back ("half" Hadamard). Per row, with c_b the Gaussian-MSE-optimal clip scale:

    σ = RMS(x),  s = c_b·σ + 1e-8,  Δ = 2s/(2^b − 1),  x̂ = (round(clamp(x, −s, s)/Δ + ½) − ½)·Δ
    ∂x̂/∂x = 1 where |x̂ − x| ≤ trust·σ, else 0;  trust = c_b/(2^b − 1) ≈ Δ/(2σ)

The outer levels are ±s, so the default mask is 0 exactly where |x| > s + Δ/2: on the entries that
clipping moves further than rounding ever could (entries in (s, s + Δ/2] are clamped but keep theirs).

Quantization stays on in eval. Alternatives: "ste", absmax RTN on the PTQ's symmetric grid
(primitives.py "sym"), straight-through; "lsq" (Esser et al. 2020, arXiv 1902.08153), a learned step.
A QATLinear keeps the Parameter of the layer it replaces, so weight tying survives (the embedding
lookup stays FP). `export_quantized` / `load_quantized_` give integer codes + scales and an int GEMM.
Unlike the authors' code, on purpose: quantizer arithmetic and the Hadamard product stay fp32 under
bf16 autocast, and the forward value is exactly x̂ (an autograd.Function, not m·x + (x̂ − m·x).detach(),
which can be one ulp off). Left out: bit packing, fused kernels, the 1.585-bit ternary
grid, quantizing attention matmuls or the KV cache (the paper keeps them FP).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.quant.hadamard import largest_pow2_divisor, rotate_blocks
from optquant.quant.layers import linear_layers, replace_module  # one layer-swapping helper for PTQ and QAT
from optquant.quant.primitives import OFF, QuantSpec, grid_range, int_params, round_to_grid
from optquant.quant.qat_config import QAT_METHODS, QATConfig

log = logging.getLogger(__name__)

def _half_cells(c: float, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Positive levels q_k = (2k−1)·c/(2^b−1), their Voronoi cells [a_k, b_k) (the last one open) and the cells'
    N(0, 1) mass."""
    from scipy.special import ndtr

    n = 2**bits
    alpha = np.arange(1, n, 2) / (n - 1)  # q_k / c
    step = 2 * c / (n - 1)
    lo = np.arange(n // 2) * step
    hi = np.append(lo[1:], np.inf)
    return alpha, lo, hi, ndtr(-lo) - ndtr(-hi)  # upper tails: no cancellation far out


def _pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # 0 at ±inf


def gaussian_mse(c: float, bits: int) -> float:
    """E[(X − x̂)²] for X ~ N(0, 1) on the QuEST grid with clip scale c: rounding and clipping error,
    integrated exactly over each level's cell (∫(x−q)²φ = (1+q²)Φ + (2q−x)φ), both signs by symmetry."""
    alpha, lo, hi, mass = _half_cells(c, bits)
    q = alpha * c
    hi_term = (2 * q - np.where(np.isinf(hi), 0.0, hi)) * _pdf(hi)  # φ(∞) = 0
    return float(2 * np.sum((1 + q * q) * mass + hi_term - (2 * q - lo) * _pdf(lo)))


def _mse_slope(c: float, bits: int) -> float:
    """−¼·dMSE/dc. Moving c moves every level q_k = α_k·c; the cell edges move too, but they sit
    midway between levels, where both neighbours' errors are equal, so they contribute nothing."""
    alpha, lo, hi, mass = _half_cells(c, bits)
    first_moment = _pdf(lo) - _pdf(hi)  # ∫ x φ over the cell
    return float(np.sum(alpha * (first_moment - alpha * c * mass)))


@functools.lru_cache(maxsize=16)
def gaussian_clip_scale(bits: int) -> float:
    """c_b = argmin_c gaussian_mse(c, b): the clip scale (in units of the row RMS) QuEST uses.

    Solved from dMSE/dc = 0 with Brent's method to machine precision. c_1 = √(2/π) exactly; c_4 =
    2.514005, where the authors' table has 2.513930578568423. All eight of their values have
    |dMSE/dc| < 1e-5, as from an optimiser's stopping rule; the MSE excess is 6e-9 at 4 bits (1.5e-3 at
    8 bits, where the MSE is flat). tests/test_qat.py compares all eight.
    """
    from scipy.optimize import brentq

    if not 1 <= bits <= 8:
        raise OptquantError(f"Gaussian clip scales exist here for 1..8 bits, got {bits}")
    return float(brentq(_mse_slope, 0.1, 10.0, args=(bits,), xtol=1e-15, rtol=4 * np.finfo(float).eps))


class _Through(torch.autograd.Function):
    """Forward: exactly xq. Backward: the gradient times the bool `mask` (None = identity)."""

    @staticmethod
    def forward(ctx, x: Tensor, xq: Tensor, mask: Tensor | None) -> Tensor:
        ctx.save_for_backward(mask)
        return xq

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (mask,) = ctx.saved_tensors
        return (grad if mask is None else grad * mask), None, None


def quest_quantize(x: Tensor, bits: int, trust: float | None = None) -> Tensor:
    """QuEST's trust quantizer on each row of x (already in the Hadamard domain); see the module doc."""
    n = 2**bits
    c = gaussian_clip_scale(bits)
    trust = c / (n - 1) if trust is None else trust  # QuEST's default: half a step, in units of σ
    with torch.no_grad():
        sigma = x.square().mean(-1, keepdim=True).sqrt()
        s = c * sigma + 1e-8
        step = 2 * s / (n - 1)
        xq = torch.clamp(x, -s, s).div_(step).add_(0.5).round_().sub_(0.5).mul_(step)
        mask = (xq - x).abs_() <= trust * sigma
    return _Through.apply(x, xq, mask)


def ste_quantize(x: Tensor, bits: int) -> Tensor:
    """Absmax RTN per row on the symmetric grid [−(2^{b−1}−1), 2^{b−1}−1], straight-through gradient.
    (primitives.py's pure functions, in x's own precision: fake_quant would round through fp32.)"""
    with torch.no_grad():
        xq = round_to_grid(x, *int_params(x, bits, "sym"), QuantSpec(bits, "sym"))
    return _Through.apply(x, xq, None)


def lsq_quantize(x: Tensor, step: Tensor, bits: int, grad_scale: float) -> Tensor:
    """LSQ: round(clamp(x/s, −Q_n, Q_p))·s; ∂/∂x = 1 inside the range, ∂/∂s = g·(round(v) − v) inside,
    g·(−Q_n or Q_p) outside (Esser et al. 2020, eq. 3), with v = x/s and g = `grad_scale`."""
    qn, qp = 2 ** (bits - 1), 2 ** (bits - 1) - 1
    s = step * grad_scale + (step - step * grad_scale).detach()  # value s, gradient scaled by g
    v = torch.clamp(x / s, -qn, qp)
    return (v + (v.round() - v).detach()) * s


class LSQStep(nn.Module):
    """A learnable LSQ step: per row (`rows` > 0) or per tensor (`rows` = 0), initialised from the
    first tensor it sees to 2·mean|x|/√Q_p (per row or overall). `weight` picks Esser's N for the
    gradient scale: a weight's entries per step; an activation's entries per example (x[0])."""

    def __init__(self, bits: int, rows: int = 0, weight: bool = False):
        super().__init__()
        self.bits, self.weight = bits, weight
        self.step = nn.Parameter(torch.ones(rows) if rows else torch.tensor(1.0))  # never 2-D: no Muon
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _init(self, x: Tensor) -> None:
        qp = 2 ** (self.bits - 1) - 1
        dims = -1 if self.step.dim() else tuple(range(x.dim()))
        value = 2 * x.detach().float().abs().mean(dims) / math.sqrt(qp)
        if self.step.dim() == 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(value)  # every rank must start from the same step
            value /= torch.distributed.get_world_size()
        self.step.copy_(value.reshape(self.step.shape).clamp_min(1e-8))
        self.initialized.fill_(True)

    def forward(self, x: Tensor) -> Tensor:
        if not self.initialized:
            self._init(x)
        step = self.step.clamp_min(1e-8)  # a step pushed below 0 would flip the grid
        if step.dim():
            step, n = step.unsqueeze(-1), x.shape[-1]
        else:
            n = x.numel() if self.weight else (x[0].numel() if x.dim() > 2 else x.shape[-1])
        return lsq_quantize(x, step.to(x.dtype), self.bits, 1 / math.sqrt(n * (2 ** (self.bits - 1) - 1)))


class QATLinear(nn.Linear):
    """nn.Linear whose forward is F.linear(Q_a(x'), Q_w(W'), b), x' = xH and W' = WH for QuEST.

    Holds the replaced layer's own weight Parameter (so tying survives). `quantize = False` bypasses
    the rounding but keeps the rotation: the output is then x Wᵀ + b up to float error.
    """

    def __init__(self, linear: nn.Linear, cfg: QATConfig):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.method, self.w_bits, self.a_bits = cfg.method, cfg.w_bits, cfg.a_bits
        self.trust, self.quantize = cfg.trust, True
        rotated = cfg.method == "quest" and cfg.hadamard_block > 0  # 128 or the largest 2^k dividing in
        self.block = largest_pow2_divisor(self.in_features, cfg.hadamard_block) if rotated else 0
        self.w_step = self.a_step = None
        if cfg.method == "lsq":
            rows = self.out_features if cfg.lsq_step == "row" else 0
            self.w_step = LSQStep(cfg.w_bits, rows, weight=True) if cfg.w_bits < OFF else None
            self.a_step = LSQStep(cfg.a_bits) if cfg.a_bits < OFF else None
            if self.w_step is not None:
                self.w_step._init(self.weight.to(self.w_step.step.device))

    def _quant(self, x: Tensor, bits: int, lsq: LSQStep | None) -> Tensor:
        if bits >= OFF or not self.quantize:
            return x
        if self.method == "quest":
            return quest_quantize(x, bits, self.trust)
        if self.method == "ste":
            return ste_quantize(x, bits)
        return lsq(x)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        with torch.autocast(x.device.type, enabled=False):
            w = self.weight.to(xf.dtype)
            if self.block:
                xf, w = rotate_blocks(xf, self.block), rotate_blocks(w, self.block)
            xq, wq = self._quant(xf, self.a_bits, self.a_step), self._quant(w, self.w_bits, self.w_step)
        return F.linear(xq, wq, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.method} w{self.w_bits}a{self.a_bits}, hadamard={self.block}"


def prepare_qat_(model: nn.Module, cfg: QATConfig) -> nn.Module:
    """Replace every nn.Linear (the LM head only if `cfg.quantize_head`) by a QATLinear; in place."""
    if any(isinstance(m, QATLinear) for m in model.modules()):
        raise OptquantError("prepare_qat_: the model already has QAT layers")
    layers = linear_layers(model, skip=() if cfg.quantize_head else ("lm_head",))
    layers = [(n, m) for n, m in layers if type(m) is nn.Linear]
    if not layers:
        raise OptquantError("prepare_qat_: the model has no nn.Linear layers to quantize")
    for name, lin in layers:
        replace_module(model, name, QATLinear(lin, cfg))
    log.info("QAT: %d linear layers use %s W%dA%d", len(layers), cfg.method, cfg.w_bits, cfg.a_bits)
    return model


def relative_degradation(fp: float, qat: float, kind: Literal["accuracy", "loss"] = "accuracy") -> float:
    """QAT's relative damage in %, positive when QAT is worse (paper.md §10.4).

    accuracy: 100·(Acc_FP − Acc_QAT)/Acc_FP, the paper's Table 4 (which prints it as a negative change);
    loss: 100·(L_QAT − L_FP)/L_FP, the same "how much worse, relative to FP" for a lower-is-better metric.
    """
    if kind not in ("accuracy", "loss") or not (math.isfinite(fp) and fp > 0):
        raise OptquantError(f"relative_degradation needs kind accuracy|loss and FP > 0, got {kind!r}, {fp}")
    return 100 * ((fp - qat) if kind == "accuracy" else (qat - fp)) / fp


def int_codes(x: Tensor, method: str, bits: int, step: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Integer codes C (int32) and per-row scales σ_C with x̂ = C·σ_C, computed directly (not through
    the fake quantizers). QuEST: odd codes ±1, ±3, …, ±(2^b−1) with scale s/(2^b−1), the nearest odd
    integer to x/scale being 2⌊x/(2·scale)⌋ + 1; STE: round(x/Δ) in ±(2^{b−1}−1); LSQ: round(x/s) in
    [−2^{b−1}, 2^{b−1}−1]. `step` is LSQ's learned step."""
    if method == "quest":
        n = 2**bits
        s = gaussian_clip_scale(bits) * x.square().mean(-1, keepdim=True).sqrt() + 1e-8
        scale = s / (n - 1)
        code = (2 * torch.floor(x / (2 * scale)) + 1).clamp(1 - n, n - 1)
    elif method == "ste":  # the grid and scale ste_quantize rounds to
        scale = int_params(x, bits, "sym")[0]
        code = torch.round(x / scale).clamp(*grid_range(bits, "sym"))
    else:
        scale = step.detach().clamp_min(1e-8).to(x.dtype)
        scale = scale.reshape(-1, 1) if scale.dim() else scale.reshape(1)
        code = torch.round(x / scale).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return code.to(torch.int32), scale


class IntLinear(nn.Module):
    """y = (C_x C_wᵀ)·σ_x σ_wᵀ + b, an int32 GEMM on activation codes computed on the fly (after the
    Hadamard rotation for QuEST). Buffers = state_dict = one layer of `export_quantized`: `meta`
    [method, w_bits, a_bits, Hadamard block], `codes` + `scale` (or float `weight` if w_bits = 16),
    `a_step` (LSQ), `bias`."""

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        for key, value in tensors.items():
            self.register_buffer(key, value.detach().clone())
        method, self.w_bits, self.a_bits, self.block = (int(v) for v in self.meta)
        self.method = QAT_METHODS[method]

    def forward(self, x: Tensor) -> Tensor:
        dtype = self.scale.dtype if self.w_bits < OFF else self.weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            xf = rotate_blocks(x.to(dtype), self.block) if self.block else x.to(dtype)
            if self.a_bits < OFF:
                cx, sx = int_codes(xf, self.method, self.a_bits, getattr(self, "a_step", None))
            if self.a_bits < OFF and self.w_bits < OFF:  # integer GEMM, then the outer product of scales
                y = (cx @ self.codes.to(torch.int32).T).to(dtype) * sx * self.scale.T
            else:  # one side in float (W4A16 / W16A4)
                xd = cx.to(dtype) * sx if self.a_bits < OFF else xf
                y = xd @ (self.codes.to(dtype) * self.scale if self.w_bits < OFF else self.weight).T
            if getattr(self, "bias", None) is not None:
                y = y + self.bias
        return y.to(x.dtype) if x.dtype in (torch.bfloat16, torch.float16) else y


@torch.no_grad()
def _export_layer(lin: QATLinear) -> dict[str, Tensor]:
    w = lin.weight.detach()
    w = w.float() if w.dtype in (torch.bfloat16, torch.float16) else w
    w = rotate_blocks(w, lin.block) if lin.block else w
    meta = [QAT_METHODS.index(lin.method), lin.w_bits, lin.a_bits, lin.block]
    out = {"meta": torch.tensor(meta, dtype=torch.int64)}
    if lin.w_bits < OFF:
        codes, scale = int_codes(w, lin.method, lin.w_bits, lin.w_step.step if lin.method == "lsq" else None)
        out["codes"] = codes.to(torch.int8 if codes.abs().max() <= 127 else torch.int16)
        out["scale"] = scale.expand(w.shape[0], 1).contiguous()
    else:
        out["weight"] = w.clone()
    if lin.method == "lsq" and lin.a_bits < OFF:
        out["a_step"] = lin.a_step.step.detach().clamp_min(1e-8).clone()
    if lin.bias is not None:
        out["bias"] = lin.bias.detach().clone()
    return out


def export_quantized(model: nn.Module) -> dict[str, Tensor]:
    """A QAT model as flat tensors: every QATLinear as `IntLinear` buffers (`<name>.codes`, `.scale`,
    `.meta` with the Hadamard block size, …), everything else (embedding, norms) as in its state_dict.
    The tied embedding stays in float; a quantized head gets its own codes. Safetensors-ready."""
    qat = {name: m for name, m in model.named_modules() if isinstance(m, QATLinear)}
    if not qat:
        raise OptquantError("export_quantized: the model has no QAT layers (call prepare_qat_ first)")
    out = {f"{name}.{k}": v for name, lin in qat.items() for k, v in _export_layer(lin).items()}
    for key, value in model.state_dict().items():
        if not any(key.startswith(name + ".") for name in qat):
            out[key] = value.detach().clone()
    return out


def load_quantized_(model: nn.Module, tensors: dict[str, Tensor]) -> nn.Module:
    """Load `export_quantized` output into a float model of the same architecture (e.g. a fresh LM):
    the exported layers become IntLinear; every other tensor is loaded strictly. In place."""
    names = [key[: -len(".meta")] for key in tensors if key.endswith(".meta")]
    if not names:
        raise OptquantError("load_quantized_: no '<layer>.meta' entries; not an export_quantized dict")
    for name in names:
        n = len(name) + 1
        replace_module(model, name, IntLinear({k[n:]: v for k, v in tensors.items() if k.startswith(name + ".")}))
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        msg = str(e).splitlines()[0]
        raise OptquantError(f"load_quantized_: the tensors do not fit the model ({msg})") from None
    return model


def convert_qat_(model: nn.Module) -> nn.Module:
    """Replace a QAT model's QATLinear layers by their IntLinear (integer) form; in place."""
    return load_quantized_(model, export_quantized(model))
