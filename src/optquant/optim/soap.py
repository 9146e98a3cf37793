"""SOAP (Vyas et al. 2024, arXiv 2409.11321): Adam in the eigenbasis of Shampoo's factors.

`pytorch_optimizer.SOAP`, measured faithful to nikhilvyas/SOAP (dependencies.md §1.2), called as the
authors did (paper.md §3): betas = (β1, β2), eps, precondition_frequency=10, max_precondition_dim=12288,
precondition_1d=False, correct_bias=True, and weight decay (the library's own default is 1e-2, so it is
always passed). Like the reference, the first step only initialises the eigenbases and leaves the
weights unchanged. State holds tensors, lists of tensors (an empty list for an unpreconditioned dim),
ints and floats: it checkpoints as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pytorch_optimizer import SOAP
from pytorch_optimizer.optimizer.utils.shape import merge_small_dims

from optquant.optim.groups import LRGroup, ParamGroups
from optquant.ranges import Count, NonNegative, Positive, Unit


@dataclass(frozen=True)
class SOAPConfig:
    """Defaults: the authors' call and CLI defaults (β1 0.9, β2 0.95, ε 1e-8); lr is the library's 3e-3."""

    name: Literal["soap"] = "soap"
    lr: Positive = 3e-3
    beta1: Unit = 0.9
    beta2: Unit = 0.95
    eps: Positive = 1e-8
    weight_decay: NonNegative = 0.0  # decoupled
    precondition_frequency: Count = 10
    max_precondition_dim: Count = 12288  # larger dims are left in the standard basis
    shampoo_beta: Unit | None = None  # EMA of the factors; None = beta2
    precondition_1d: bool = False
    correct_bias: bool = True
    merge_dims: bool = False

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
        """pytorch_optimizer.SOAP (`init_pre_conditioner`, `get_orthogonal_matrix`): exp_avg and exp_avg_sq,
        and per dim of the (optionally merged) shape an n×n factor GG and eigenbasis Q when n ≤
        `max_precondition_dim` (a 1-D parameter only with `precondition_1d`); larger dims get neither."""
        if len(shape) == 1:
            dims = list(shape) if self.precondition_1d else []
        else:
            dims = list(merge_small_dims(shape, self.max_precondition_dim)) if self.merge_dims else list(shape)
        return (2 * math.prod(shape) + sum(2 * n * n for n in dims if n <= self.max_precondition_dim)) * element_size

    def lr_groups(self) -> list[LRGroup]:
        return [LRGroup(("embeddings", "vectors"), self.lr), LRGroup(("matrices",), self.lr)]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        params = [{"params": g} for g in (groups.embeddings + groups.vectors, groups.matrices) if g]
        return [
            SOAP(
                params,
                lr=self.lr,
                betas=(self.beta1, self.beta2),
                shampoo_beta=self.shampoo_beta,
                eps=self.eps,
                weight_decay=self.weight_decay,
                precondition_frequency=self.precondition_frequency,
                max_precondition_dim=self.max_precondition_dim,
                merge_dims=self.merge_dims,
                precondition_1d=self.precondition_1d,
                correct_bias=self.correct_bias,
            )
        ]
