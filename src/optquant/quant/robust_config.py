"""RobustConfig: train so that W4A4 quantization does less damage, with any optimizer (robust.py does it).

Kept apart from robust.py, as qat_config.py is from qat.py, so that a RunConfig does not load the code.
`method="none"` (the default) is the plain run: config_hash leaves the section out, so every run id from
before it existed stays valid, and the training loop takes its old path bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import Meta

from optquant.errors import OptquantError
from optquant.ranges import Count

RobustMethod = Literal["none", "penalty", "gain", "late-qat", "ema", "lawa", "lawa-live"]
ROBUST_METHODS: tuple[str, ...] = get_args(RobustMethod)
AVERAGES = ("ema", "lawa", "lawa-live")  # the methods whose run evaluates and saves a weight average
# `strength` when it is left unset: penalty λ, gain target τ, late-QAT fraction of the steps, EMA decay β
# (a window of ~50 steps: the study's runs are a few hundred steps long), LAWA's k checkpoints
DEFAULT_STRENGTH = {"penalty": 0.1, "gain": 4.0, "late-qat": 0.2, "ema": 0.98, "lawa": 5.0, "lawa-live": 5.0}
# The robust arm the `cpu-robust` study preset runs (issue 32): two strengths of each averaging, windows of ~20
# and ~100 steps at the default study's 183 (femto) and 545 (pico) steps (lawa keeps a checkpoint every 25),
# and the LR decay off and doubled against the plain 0.2. The report's Seeds table is its power calculation.
RECOMMENDED_ARM = ("ema:0.95", "ema:0.99", "lawa:2", "lawa:4", "decay:0", "decay:0.4")


@dataclass(frozen=True)
class RobustConfig:
    """One method and its strength (robust.py's docstring has each one's formula and cost).

    penalty   λ·R_L of a W4A4 RTN copy on the step's batch, straight-through; strength = λ ≥ 0
    gain      cap each linear's worst-case error gain ‖W‖₂²‖H‖²/‖WH‖² at τ after the optimizer step;
              strength = τ ≥ 1 (lower = stronger)
    late-qat  QuEST W{bits}A{bits} for the last fraction of the steps; strength = that fraction in (0, 1]
    ema       evaluate and save an EMA of the weights (averaging.py), updated every `every`-th step;
              strength = the decay β in [0, 1)
    lawa      evaluate and save the equal average of the last k kept checkpoints (every train.eval_every
              steps; `every` must stay 1); strength = k, a whole number ≥ 1
    lawa-live lawa with the current weights always the newest of the k (averaging.py): the same kept and
              final models, and an average that moves with every step (and jumps as its oldest checkpoint leaves)
    """

    method: RobustMethod = "none"
    strength: float | None = None  # None = DEFAULT_STRENGTH[method]
    every: Count = 1  # penalty / gain: on every k-th optimizer step (steps 0, k, 2k, ...)
    # the quantizer's weight and activation bits (W4A4 as the study's PTQ and QAT)
    bits: Annotated[int, Meta(ge=2, le=8)] = 4

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
        if self.method == "ema" and not 0 <= v < 1:
            raise OptquantError(f"robust.strength={v}: the EMA's decay β must be in [0, 1)")
        if self.method.startswith("lawa") and (v < 1 or v != int(v)):
            raise OptquantError(f"robust.strength={v}: LAWA's number of checkpoints k must be a whole number >= 1")
        if self.method.startswith("lawa") and self.every != 1:
            raise OptquantError(f"robust.every={self.every}: LAWA averages the kept checkpoints (every "
                                "train.eval_every steps); leave robust.every at 1")


def entry_overrides(entry: str) -> tuple[str, ...]:
    """A study's robust-arm entry `method[:strength[:every]]` (e.g. `penalty:0.3:4`) as run overrides;
    `decay:f` is the plain run with train.decay_frac=f: `decay:0` has no decay, so its final model is the
    end of the stable phase at the same budget (a WSD run's weights up to its decay do not depend on the
    decay's length), and `decay:0.1`, `decay:0.4` vary the decay's length against the plain 0.2. An entry
    `model.FIELD=VALUE` is the plain run with that architecture option, e.g. `model.block=op` (the Outlier
    Protected block) or `model.attn_gate=true` (gated attention; model.py); options joined by `+` are one arm,
    e.g. OSP's architecture `model.norm=single+model.embed_proj=true`."""
    if entry.startswith("model."):  # architecture options as the arm
        options = tuple(entry.split("+"))
        if not all(o.startswith("model.") and "=" in o for o in options):
            raise OptquantError(f"robust={entry!r}: expected model.FIELD=VALUE options joined by +")
        return options
    parts = entry.split(":")
    method, strength, every = (*parts, "", "")[:3]
    if method == "decay" and len(parts) == 2 and strength:  # the LR decay as the variable (no robust method)
        return (f"train.decay_frac={strength}",)
    if len(parts) > 3 or method not in ROBUST_METHODS[1:]:
        raise OptquantError(f"robust={entry!r}: expected method[:strength[:every]] with method one of "
                            f"{', '.join(ROBUST_METHODS[1:])}, or decay:FRACTION, or model.FIELD=VALUE")
    return (f"robust.method={method}", *((f"robust.strength={strength}",) if strength else ()),
            *((f"robust.every={every}",) if every else ()))
