"""RobustConfig: train so that W4A4 quantization does less damage, with any optimizer (robust.py does it).

Kept apart from robust.py, as qat_config.py is from qat.py, so that a RunConfig does not load the code.
`method="none"` (the default) is the plain run: config_hash leaves the section out, so every run id from
before it existed stays valid, and the training loop takes its old path bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optquant.errors import OptquantError

ROBUST_METHODS: tuple[str, ...] = ("none", "penalty", "gain", "late-qat")
# `strength` when it is left unset: penalty λ, gain target τ, late-QAT fraction of the steps
DEFAULT_STRENGTH = {"penalty": 0.1, "gain": 4.0, "late-qat": 0.2}


@dataclass(frozen=True)
class RobustConfig:
    """One method and its strength (robust.py's docstring has each one's formula and cost).

    penalty   λ·R_L of a W4A4 RTN copy on the step's batch, straight-through; strength = λ ≥ 0
    gain      cap each linear's worst-case error gain ‖W‖₂²‖H‖²/‖WH‖² at τ after the optimizer step;
              strength = τ ≥ 1 (lower = stronger)
    late-qat  QuEST W{bits}A{bits} for the last fraction of the steps; strength = that fraction in (0, 1]
    """

    method: Literal["none", "penalty", "gain", "late-qat"] = "none"
    strength: float | None = None  # None = DEFAULT_STRENGTH[method]
    every: int = 1  # penalty / gain: on every k-th optimizer step (steps 0, k, 2k, ...)
    bits: int = 4  # the quantizer's weight and activation bits (W4A4 as the study's PTQ and QAT)

    @property
    def value(self) -> float:
        return DEFAULT_STRENGTH.get(self.method, 0.0) if self.strength is None else self.strength

    def check(self) -> None:
        """The constraints between fields (config.validate calls it once all overrides are applied)."""
        v = self.value
        if self.method == "penalty" and v < 0:
            raise OptquantError(f"robust.strength={v}: the penalty's λ must be >= 0")
        if self.method == "gain" and v < 1:
            raise OptquantError(f"robust.strength={v}: the gain target τ must be >= 1 (the flattest spectrum)")
        if self.method == "late-qat" and not 0 < v <= 1:
            raise OptquantError(f"robust.strength={v}: late QAT's fraction of the steps must be in (0, 1]")
        if not 2 <= self.bits <= 8:
            raise OptquantError(f"robust.bits={self.bits}: must be in 2..8")


def entry_overrides(entry: str) -> tuple[str, ...]:
    """A study's robust-arm entry `method[:strength[:every]]` (e.g. `penalty:0.3:4`) as run overrides."""
    parts = entry.split(":")
    method, strength, every = (*parts, "", "")[:3]
    if len(parts) > 3 or method not in ROBUST_METHODS[1:]:
        raise OptquantError(f"robust={entry!r}: expected method[:strength[:every]] with method one of "
                            f"{', '.join(ROBUST_METHODS[1:])}")
    return (f"robust.method={method}", *((f"robust.strength={strength}",) if strength else ()),
            *((f"robust.every={every}",) if every else ()))
