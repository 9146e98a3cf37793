"""QATConfig: what `prepare_qat_` (qat.py) does to a model. Kept apart from qat.py so that a RunConfig,
which carries one, does not load the QAT code (or PTQ's) when it is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optquant.errors import OptquantError
from optquant.quant.primitives import OFF
from optquant.ranges import Positive

QAT_METHODS: tuple[str, ...] = ("quest", "ste", "lsq")


@dataclass(frozen=True)
class QATConfig:
    """Defaults = the paper: QuEST W4A4 on every linear layer including the LM head."""

    method: Literal["quest", "ste", "lsq"] = "quest"
    w_bits: int = 4  # 16 = weights not quantized
    a_bits: int = 4  # 16 = activations not quantized
    quantize_head: bool = True  # the authors' code quantizes the (tied) LM head; the embedding stays FP
    hadamard_block: int = 128  # QuEST only: largest Hadamard block; 0 = no rotation
    trust: Positive | None = None  # QuEST only: None = c_b/(2^b − 1), i.e. zero gradient beyond s + Δ/2
    lsq_step: Literal["row", "tensor"] = "row"  # LSQ weight step per output row or per tensor

    def __post_init__(self) -> None:
        low = 1 if self.method == "quest" else 2
        for field in ("w_bits", "a_bits"):
            bits = getattr(self, field)
            if not (low <= bits <= 8 or bits == OFF):
                raise OptquantError(f"qat.{field}={bits}: {self.method} takes {low}..8 bits, or 16 = off")
        if self.hadamard_block < 0 or self.hadamard_block & (self.hadamard_block - 1):
            raise OptquantError(f"qat.hadamard_block must be 0 or a power of two, got {self.hadamard_block}")
