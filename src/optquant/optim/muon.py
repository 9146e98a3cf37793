"""Muon (KellerJordan/Muon, arXiv 2502.16982) on the hidden matrices, AdamW on the embedding and vectors.

The authors ran `muon.SingleDeviceMuon(hidden, lr, momentum, weight_decay)` and, for the rest,
`AdamW(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, same weight decay, fused=True)` (paper.md §3). Muon's step:
m ← β·m + (1−β)·g; u = (1−β)·g + β·m (Nesterov); O = NS5(u) (5 quintic Newton–Schulz steps in bf16 with
(a, b, c) = (3.4445, −4.7750, 2.0315) after dividing by ‖u‖_F); W ← W·(1 − lr·λ) − lr·√max(1, rows/cols)·O.
`torch.optim.Muon` computes exactly this when its lr adjustment is "original" (dependencies.md §1.2:
6e-3 from the reference after 30 steps, bf16 rounding). Its defaults differ from the paper's and are set
explicitly here: weight_decay 0.1 → the config's (0), `adjust_lr_fn` → "original".

The schedule multiplies the AdamW group's fixed 3e-3 too, like the authors' scheduler.
Left out: Muon's distributed variant (the authors ran the single-device one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from optquant.optim.groups import ParamGroups


@dataclass(frozen=True)
class MuonConfig:
    """Defaults: the authors' README example (lr 3e-2, momentum 0.95) and their AdamW for the rest."""

    name: Literal["muon"] = "muon"
    lr: float = 3e-2
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    weight_decay: float = 0.0  # decoupled, for both Muon and its AdamW (torch.optim.Muon's default is 0.1)
    adjust_lr: Literal["original", "match_rms_adamw"] = "original"  # original: √max(1, rows/cols)
    adam_lr: float = 3e-3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-6

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        optimizers: list[torch.optim.Optimizer] = []
        if groups.matrices:
            optimizers.append(
                torch.optim.Muon(
                    groups.matrices,
                    lr=self.lr,
                    weight_decay=self.weight_decay,
                    momentum=self.momentum,
                    nesterov=self.nesterov,
                    ns_steps=self.ns_steps,
                    adjust_lr_fn=self.adjust_lr,
                )
            )
        rest = [g for g in (groups.embeddings, groups.vectors) if g]
        if rest:
            optimizers.append(
                torch.optim.AdamW(
                    [{"params": g} for g in rest],
                    lr=self.adam_lr,
                    betas=(self.adam_beta1, self.adam_beta2),
                    eps=self.adam_eps,
                    weight_decay=self.weight_decay,
                    fused=True,
                )
            )
        return optimizers
