# quant/ptq.py before issue 33 (main at 03afe56), kept verbatim as the reference the block-sequential GPTQ
# must match (tests/test_ptq.py). Not used by the package.
"""Post-training quantization of a model: `quantize_(model, PTQConfig(...), calib=None)`.

The paper's PTQ (arXiv 2509.23500, paper.md §5): W4A4 symmetric AbsMax RTN of every linear layer in
the transformer blocks, weights per output channel, activations per token, dynamic (computed on the
fly for each input). That is `PTQConfig()`. Beyond it, as settings: GPTQ weights, a Hadamard
rotation first (`optquant.quant.rotate.rotate_model_`), weight-only (a_bits=16), groups, other
integer grids, MXFP4/NVFP4, and quantizing the LM head.

Each chosen nn.Linear becomes a `QuantLinear` holding its dequantized weight Ŵ (so ε^W = Ŵ − W can be
read off `.weight`) and the activation spec: forward(x) = x̂ Ŵᵀ with x̂ = fake_quant(x).

GPTQ is sequential, as in the gptq/QuaRot references: the calibration data runs through the model
with the already-quantized earlier layers in place, so each layer's Hessian comes from the inputs it
will really see. Layers are processed in the order the forward pass actually calls them; layers that
read the very same input tensor (q/k/v, gate/up) share one pass and are quantized together from the
same Hessian. Each pass stops (via an exception from a hook) as soon as the next input arrives, so a
model with L groups costs about L/2 forward passes. During calibration activations stay unquantized
(QuaRot's order: GPTQ weights first, then activation quantizers are switched on).

Left out on purpose: caching block inputs (the generic early-stopping pass works for any module
tree), static activation scales, KV-cache / attention-matmul quantization (the paper keeps them FP).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.quant.gptq import accumulate_hessian, gptq_quantize
from optquant.quant.layers import QuantLinear, linear_layers, replace_module
from optquant.quant.primitives import FORMATS, GRIDS, OFF, Format, Grid, QuantSpec, fake_quant

log = logging.getLogger(__name__)

GPTQ_BLOCK_SIZE = 128  # lazy-batch width: a speed knob only (exact arithmetic gives the same result)
_CALIB_BATCH = 8  # calibration sequences per forward when calib is one (N, T) tensor


@dataclass(frozen=True)
class PTQConfig:
    """A PTQ scheme. Defaults = the paper: W4A4 RTN, symmetric [−7, 7], per channel / per token."""

    method: Literal["rtn", "gptq"] = "rtn"
    w_bits: int = 4  # 16 = weights not quantized
    a_bits: int = 4  # 16 = activations not quantized (weight-only)
    format: Format = "int"  # "mxfp4" / "nvfp4" fix 4 bits and their own blocks
    grid: Grid = "sym"  # integer grid, see primitives.py: "sym" [−7,7], "sym8"/"full" [−8,7], "odd", "asym"
    w_group_size: int = 0  # 0 = one scale per output channel
    a_group_size: int = 0  # 0 = one scale per token
    quantize_head: bool = False  # a tied head gets its own quantized weight; the embedding stays FP
    rotation: Literal["none", "hadamard"] = "none"
    damp: float = 0.01  # GPTQ: λ in H + λ·mean(diag H)·I
    act_order: bool = False  # GPTQ: columns by decreasing diag H
    n_calib: int = 128  # GPTQ: calibration sequences

    def __post_init__(self) -> None:
        if self.method not in ("rtn", "gptq"):
            raise OptquantError(f"ptq.method must be 'rtn' or 'gptq', got {self.method!r}")
        if self.rotation not in ("none", "hadamard"):
            raise OptquantError(f"ptq.rotation must be 'none' or 'hadamard', got {self.rotation!r}")
        if self.format not in FORMATS or self.grid not in GRIDS:
            raise OptquantError(f"ptq.format must be in {FORMATS} and ptq.grid in {GRIDS}")
        for field in ("w_bits", "a_bits"):
            bits = getattr(self, field)
            if not 2 <= bits <= OFF or (self.format != "int" and bits not in (4, OFF)):
                raise OptquantError(f"ptq.{field}={bits} is not 2..16 (16 = off; 4 or 16 for {self.format})")
        if self.w_group_size < 0 or self.a_group_size < 0:
            raise OptquantError("ptq group sizes must be >= 0 (0 = per channel / per token)")
        if self.damp <= 0 or self.n_calib < 1:
            raise OptquantError(f"ptq.damp must be > 0 and ptq.n_calib >= 1, got {self.damp}, {self.n_calib}")

    @property
    def weight_spec(self) -> QuantSpec | None:
        """How weights are quantized; None when w_bits = 16."""
        return _spec(self.w_bits, self.grid, self.format, self.w_group_size, "channel")

    @property
    def act_spec(self) -> QuantSpec | None:
        """How layer inputs are quantized (dynamically); None when a_bits = 16."""
        return _spec(self.a_bits, self.grid, self.format, self.a_group_size, "token")

    @property
    def name(self) -> str:
        """Stable short label used as a results key, e.g. "w4a4-rtn", "w4a16-gptq-g128-ao-had".

        Parts: w/a bits, method, format or non-default grid, g<w_group_size>, ag<a_group_size>, "ao"
        (act_order), "had" (rotation), "head" (LM head quantized). GPTQ's damp and n_calib are not in it.
        """
        parts = [f"w{self.w_bits}a{self.a_bits}", self.method]
        if self.format != "int":
            parts.append(self.format)
        elif self.grid != "sym":
            parts.append(self.grid)
        if self.format == "int" and self.w_group_size and self.w_bits < OFF:
            parts.append(f"g{self.w_group_size}")
        if self.format == "int" and self.a_group_size and self.a_bits < OFF:
            parts.append(f"ag{self.a_group_size}")
        if self.method == "gptq" and self.act_order:
            parts.append("ao")
        if self.rotation == "hadamard":
            parts.append("had")
        if self.quantize_head:
            parts.append("head")
        return "-".join(parts)


def _spec(bits: int, grid: str, fmt: str, group: int, per_row: str) -> QuantSpec | None:
    if bits >= OFF:
        return None
    return QuantSpec(bits, grid, "group" if group else per_row, group or 128, fmt)


# Named schemes for sweeps; keys are the configs' own names.
SCHEMES: dict[str, PTQConfig] = {
    c.name: c
    for c in (
        PTQConfig(),
        PTQConfig(rotation="hadamard"),
        PTQConfig(method="gptq"),
        PTQConfig(method="gptq", rotation="hadamard"),
        PTQConfig(a_bits=16, method="gptq", w_group_size=128),
        PTQConfig(a_bits=16),
        PTQConfig(format="mxfp4"),
        PTQConfig(format="nvfp4"),
        PTQConfig(w_bits=8, a_bits=8),
        PTQConfig(grid="full"),  # the paper's scheme on llm-compressor's / torchao's int4 grid
        PTQConfig(a_bits=16, method="gptq", w_group_size=128, grid="full"),  # llm-compressor's W4A16 scheme, our GPTQ
    )
}


@torch.no_grad()
def quantize_(model: nn.Module, cfg: PTQConfig, calib: Tensor | Iterable | None = None) -> nn.Module:
    """Quantize `model` in place with `cfg`; returns it.

    `calib` (GPTQ only): model inputs, either one tensor whose first axis is sequences, or an iterable
    of batches (each a tensor or a tuple whose first item is the input); the first `cfg.n_calib`
    sequences are used.
    """
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise OptquantError("the model is already quantized; quantize a fresh copy")
    if cfg.method == "gptq" and cfg.w_bits < OFF and calib is None:
        raise OptquantError("ptq.method='gptq' needs calibration data (calib=...)")
    if cfg.rotation == "hadamard":
        from optquant.quant.rotate import rotate_model_  # only the rotated schemes need it

        rotate_model_(model)
    layers = linear_layers(model, skip=() if cfg.quantize_head else ("lm_head",))
    check_group_sizes(layers, cfg)
    if cfg.method == "gptq" and cfg.w_bits < OFF:
        _gptq_(model, layers, cfg, calib)
    else:
        for name, lin in layers:
            spec = cfg.weight_spec
            W = lin.weight.detach().clone() if spec is None else fake_quant(lin.weight.detach(), spec)
            replace_module(model, name, QuantLinear(W, lin.bias, cfg.act_spec, cfg.name))
    log.info("quantized %d linear layers with %s", len(layers), cfg.name)
    return model


def check_group_sizes(layers: list[tuple[str, nn.Linear]], cfg: PTQConfig) -> None:
    """A weight or activation group must tile each layer's input width exactly: no ragged last group.
    A group at least as wide as a layer is one group per row (the zero padding never changes a scale)."""
    for what, group, bits in (("w_group_size", cfg.w_group_size, cfg.w_bits), ("a_group_size", cfg.a_group_size,
                                                                                 cfg.a_bits)):
        if cfg.format != "int" or not group or bits >= OFF:
            continue
        bad = sorted({lin.in_features for _, lin in layers if group < lin.in_features and lin.in_features % group})
        if bad:
            raise OptquantError(f"ptq.{what}={group} does not divide the input width(s) {bad} of this model's "
                                "linear layers; choose a divisor")


def quantized_copy(model: nn.Module, cfg: PTQConfig, calib: Tensor | Iterable | None = None) -> nn.Module:
    """A quantized deep copy of `model`; the original is untouched."""
    return quantize_(copy.deepcopy(model), cfg, calib)


def _calib_batches(calib: Tensor | Iterable, n: int, device: torch.device) -> list[Tensor]:
    if isinstance(calib, Tensor):
        calib = calib[:n].split(_CALIB_BATCH)
    batches, seen = [], 0
    for item in calib:
        x = item[0] if isinstance(item, tuple | list) else item
        x = x[: n - seen]
        batches.append(x.to(device))
        seen += x.shape[0]
        if seen >= n:
            break
    if not batches:
        raise OptquantError("GPTQ: the calibration data is empty")
    return batches


class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the current input group is captured."""


def _capture_group(model: nn.Module, pending: dict[str, nn.Module], batches: list[Tensor]) -> dict:
    """Hessians of the first pending layers the forward calls, all reading the same input tensor."""
    acc: dict[str, tuple[Tensor | None, int]] = {}
    state: dict[str, Tensor | None] = {"input": None}

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if state["input"] is None:
                state["input"] = x
            elif x is not state["input"]:
                raise _Stop
            acc[name] = accumulate_hessian(*acc.get(name, (None, 0)), x)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(name)) for name, m in pending.items()]
    try:
        for batch in batches:
            state["input"] = None
            try:
                model(batch)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return {name: H for name, (H, _) in acc.items()}


def _gptq_(model: nn.Module, layers: list[tuple[str, nn.Module]], cfg: PTQConfig, calib) -> None:
    device = next(model.parameters()).device
    batches = _calib_batches(calib, cfg.n_calib, device)
    pending = dict(layers)
    done: list[QuantLinear] = []
    while pending:
        hessians = _capture_group(model, pending, batches)
        if not hessians:
            log.warning("GPTQ: %d layers never ran on the calibration data; using RTN", len(pending))
            for name, lin in pending.items():
                Q = fake_quant(lin.weight.detach(), cfg.weight_spec)
                done.append(replace_module(model, name, QuantLinear(Q, lin.bias, None, cfg.name)))
            break
        for name, H in hessians.items():
            lin = pending.pop(name)
            spec, bs = cfg.weight_spec, GPTQ_BLOCK_SIZE
            Q = gptq_quantize(lin.weight, H, spec, damp=cfg.damp, block_size=bs, act_order=cfg.act_order)
            done.append(replace_module(model, name, QuantLinear(Q, lin.bias, None, cfg.name)))
            log.debug("GPTQ quantized %s", name)
    for layer in done:  # activations stayed FP during calibration; switch their quantizers on now
        layer.act = cfg.act_spec
