"""Quantization: pure RTN primitives and FP4 formats, GPTQ, Hadamard rotation, PTQ and QAT.

Reading order: primitives.py (grids, scales, fake_quant) → formats.py (MXFP4/NVFP4) → gptq.py →
layers.py (QuantLinear, linear_layers, replace_module) → ptq.py (`quantize_(model, PTQConfig(...),
calib)`; `SCHEMES` names the schemes the study sweeps). rotate.py and qat.py (with qat_config.py) build on
these. Everything is fake quantization in fp32. Import from the modules: this package file imports
nothing, so that importing a config (qat_config.py) does not load PTQ, GPTQ or QAT.
"""
