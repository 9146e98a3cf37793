"""Split a model's parameters into the paper's three groups (paper.md §3, the authors' "np" parametrization).

- embeddings: the input embedding (= tied LM head) and an untied LM head, if any;
- vectors: every parameter with ndim != 2 (RMSNorm gains, the (1, H, 1, 1) QK scales);
- matrices: every other 2-D parameter, i.e. the hidden q/k/v/o and MLP weights inside the blocks (and
  OSP's embedding projections, model.embed_proj, which OSP trains with Muon).

Also the two steps every `Optimizer.step` written here begins with: the closure's loss, and a group's
parameters that have a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from optquant.errors import OptquantError


@dataclass(frozen=True)
class ParamGroups:
    embeddings: list[Tensor]
    vectors: list[Tensor]
    matrices: list[Tensor]

    def all(self) -> list[Tensor]:
        return self.embeddings + self.vectors + self.matrices


class LRGroup(NamedTuple):
    """One param group as an optimizer's `build` packs it (its `lr_groups`, in build's order): the groups above
    it holds, its base lr, whether that moves with lr (lr itself, or a multiple tied by the `ratio` field)."""

    kinds: tuple[str, ...]  # of "embeddings", "vectors", "matrices"
    lr: float
    tied: bool = True
    ratio: str | None = None


def split_params(model: nn.Module) -> ParamGroups:
    embeddings, vectors, matrices = [], [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if not p.requires_grad:
            continue
        if p.ndim != 2:  # first: a QAT head's LSQ step sizes are vectors, not embeddings
            vectors.append(p)
        elif name in ("embed.weight", "lm_head.weight"):  # not embed.proj.weight (model.embed_proj): a matrix
            embeddings.append(p)
        else:
            matrices.append(p)
    return ParamGroups(embeddings, vectors, matrices)


def closure_loss(closure: Callable[[], Tensor] | None) -> Tensor | None:
    """torch.optim's `step(closure)`: the closure re-evaluates the loss with gradients on (a step runs
    under no_grad); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def dense_params(group: dict, who: str) -> list[Tensor]:
    """The group's parameters that have a gradient; a sparse gradient or a complex parameter is refused."""
    params = [p for p in group["params"] if p.grad is not None]
    if any(p.grad.is_sparse or torch.is_complex(p) for p in params):
        raise OptquantError(f"{who} supports dense real parameters only")
    return params
