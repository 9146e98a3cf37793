"""Muon (KellerJordan/Muon, arXiv 2502.16982) on the hidden matrices, AdamW on the embedding and vectors.

The authors ran `muon.SingleDeviceMuon(hidden, lr, momentum, weight_decay)` and, for the rest,
`AdamW(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, same weight decay, fused=True)` (paper.md §3). Muon's step:
m ← β·m + (1−β)·g; u = (1−β)·g + β·m (Nesterov); O = NS5(u) (5 quintic Newton–Schulz steps in `ns_dtype` with
(a, b, c) = (3.4445, −4.7750, 2.0315) after dividing by ‖u‖_F); W ← W·(1 − lr·λ) − lr·√max(1, rows/cols)·O.
`torch.optim.Muon` computes exactly this when its lr adjustment is "original" (dependencies.md §1.2:
6e-3 from the reference after 30 steps, bf16 rounding). Its defaults differ from the paper's and are set
explicitly here: weight_decay 0.1 → the config's (0), `adjust_lr_fn` → "original".

The AdamW group's step size is either the authors' fixed `adam_lr` = 3e-3 (their value at 50M+, kept for
the `paper` preset) or, with `adam_lr_ratio` > 0, tied to Muon's: adam_lr = adam_lr_ratio × lr, so that an LR
search moves both and a study can search the ratio (study/tuning.py). The schedule multiplies it either way,
like the authors' scheduler.
Left out: Muon's distributed variant (the authors ran the single-device one).

Newton–Schulz runs in `ns_dtype` (optim/newton_schulz.py, shared with Scion): in "bf16", torch's (and the
authors') choice, our step is bitwise `torch.optim.Muon`'s (tests/test_optim.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import Tensor

from optquant.optim.adamw import AdamWConfig
from optquant.optim.groups import LRGroup, ParamGroups, closure_loss, dense_params
from optquant.optim.newton_schulz import DTYPES, newton_schulz_many, resolve_ns_dtype, set_ns_dtype_
from optquant.ranges import Count, NonNegative, Positive, Unit


def momentum_direction(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """m ← β·m + (1−β)·g (in place on `buf`); returns u = (1−β)·g + β·m if Nesterov, else m."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def lr_scale(adjust_lr: str | None, shape: torch.Size) -> float:
    """"original": √max(1, rows/cols) (KellerJordan); "match_rms_adamw": 0.2·√max(rows, cols) (Moonshot)."""
    rows, cols = shape[:2]
    if adjust_lr in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr == "match_rms_adamw" else 1.0


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` whose Newton–Schulz runs in each group's `ns_dtype` ("bf16": torch's own step)."""

    def __init__(self, params, ns_dtype: Literal["bf16", "fp32"] = "bf16", **kwargs):
        super().__init__(params, **kwargs)
        set_ns_dtype_(self, ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            dtype = DTYPES[group.setdefault("ns_dtype", self.defaults["ns_dtype"])]  # older checkpoints: bf16
            params = dense_params(group, "Muon")
            directions = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                directions.append(momentum_direction(p.grad, state["momentum_buffer"], group["momentum"],
                                                     group["nesterov"]))
            updates = newton_schulz_many(directions, group["ns_steps"], dtype, coefficients=group["ns_coefficients"],
                                         eps=group["eps"])
            for p, update in zip(params, updates, strict=True):
                p.mul_(1 - lr * weight_decay)
                p.add_(update, alpha=-lr * lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


@dataclass(frozen=True)
class MuonConfig:
    """Defaults: the authors' README example (lr 3e-2, momentum 0.95) and their AdamW for the rest."""

    name: Literal["muon"] = "muon"
    lr: Positive = 3e-2
    momentum: Unit = 0.95
    nesterov: bool = True
    ns_steps: Count = 5
    weight_decay: NonNegative = 0.0  # decoupled, for both Muon and its AdamW (torch.optim.Muon's default is 0.1)
    adjust_lr: Literal["original", "match_rms_adamw"] = "original"  # original: √max(1, rows/cols)
    adam_lr: Positive = 3e-3  # the AdamW group's fixed step size (the authors'), used when adam_lr_ratio is 0
    adam_lr_ratio: NonNegative = 0.0  # > 0: the AdamW group's step size is adam_lr_ratio × lr (tied to the LR search)
    adam_beta1: Unit = 0.9
    adam_beta2: Unit = 0.95
    adam_eps: Positive = 1e-6
    ns_dtype: Literal["auto", "bf16", "fp32"] = "auto"  # Newton–Schulz; bf16 = torch's; auto = as precision

    # group step sizes a study can tie to lr and search: label -> (fixed field, ratio field)
    GROUP_LRS: ClassVar[dict[str, tuple[str, str]]] = {"adamw": ("adam_lr", "adam_lr_ratio")}

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
        """torch.optim.Muon's one momentum buffer per matrix; the rest is the AdamW optimizer's state."""
        if group == "matrices":
            return math.prod(shape) * element_size
        return AdamWConfig().state_bytes(shape, element_size, group)

    def lr_groups(self) -> list[LRGroup]:
        tied = self.adam_lr_ratio > 0
        adam_lr = self.adam_lr_ratio * self.lr if tied else self.adam_lr
        return [LRGroup(("matrices",), self.lr), *(LRGroup((kind,), adam_lr, tied, "adam_lr_ratio")
                                                   for kind in ("embeddings", "vectors"))]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        optimizers: list[torch.optim.Optimizer] = []
        if groups.matrices:
            optimizers.append(
                Muon(
                    groups.matrices,
                    ns_dtype=resolve_ns_dtype(self.ns_dtype, groups.matrices),
                    lr=self.lr,
                    weight_decay=self.weight_decay,
                    momentum=self.momentum,
                    nesterov=self.nesterov,
                    ns_steps=self.ns_steps,
                    adjust_lr_fn=self.adjust_lr,
                )
            )
        if groups.embeddings or groups.vectors:  # the rest: the AdamW optimizer's own build, without the matrices
            adamw = AdamWConfig(lr=self.lr_groups()[-1].lr, beta1=self.adam_beta1, beta2=self.adam_beta2,
                                eps=self.adam_eps, weight_decay=self.weight_decay)
            optimizers += adamw.build(replace(groups, matrices=[]))
        return optimizers
