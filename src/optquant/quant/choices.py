"""The words a PTQ scheme is made of, without torch: PTQConfig's and QuantSpec's fields are typed by them,
and `optquant ptq`'s choice lists read them here, so that `--help` loads no quantizer."""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["rtn", "gptq"]
Format = Literal["int", "mxfp4", "nvfp4"]
Grid = Literal["sym", "sym8", "full", "odd", "asym"]
Rotation = Literal["none", "hadamard"]
METHODS: tuple[str, ...] = get_args(Method)
FORMATS: tuple[str, ...] = get_args(Format)
GRIDS: tuple[str, ...] = get_args(Grid)
ROTATIONS: tuple[str, ...] = get_args(Rotation)
