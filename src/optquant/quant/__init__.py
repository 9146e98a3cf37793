"""Quantization: pure RTN primitives and FP4 formats, GPTQ, Hadamard rotation, PTQ and QAT.

Reading order: primitives.py (grids, scales, fake_quant) → formats.py (MXFP4/NVFP4) → gptq.py →
ptq.py (`quantize_(model, PTQConfig(...), calib)`; `SCHEMES` names the schemes the study sweeps).
rotate.py and qat.py build on these. Everything is fake quantization in fp32.
"""

from optquant.quant.gptq import accumulate_hessian, gptq_quantize, layer_error
from optquant.quant.primitives import QuantSpec, fake_quant, quant_params, round_to_grid
from optquant.quant.ptq import (
    SCHEMES,
    PTQConfig,
    QuantLinear,
    fake_quant_activation,
    linear_layers,
    quantize_,
    quantized_copy,
    replace_module,
)

__all__ = [
    "SCHEMES",
    "PTQConfig",
    "QuantLinear",
    "QuantSpec",
    "accumulate_hessian",
    "fake_quant",
    "fake_quant_activation",
    "gptq_quantize",
    "layer_error",
    "linear_layers",
    "quant_params",
    "quantize_",
    "quantized_copy",
    "replace_module",
    "round_to_grid",
]
