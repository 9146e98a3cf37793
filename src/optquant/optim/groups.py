"""Split a model's parameters into the paper's three groups (paper.md §3, the authors' "np" parametrization).

- embeddings: the input embedding (= tied LM head) and an untied LM head, if any;
- vectors: every parameter with ndim != 2 (RMSNorm gains, the (1, H, 1, 1) QK scales);
- matrices: every other 2-D parameter, i.e. the hidden q/k/v/o and MLP weights inside the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ParamGroups:
    embeddings: list[Tensor]
    vectors: list[Tensor]
    matrices: list[Tensor]

    def all(self) -> list[Tensor]:
        return self.embeddings + self.vectors + self.matrices


def split_params(model: nn.Module) -> ParamGroups:
    embeddings, vectors, matrices = [], [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if not p.requires_grad:
            continue
        if p.ndim != 2:  # first: a QAT head's LSQ step sizes are vectors, not embeddings
            vectors.append(p)
        elif name.startswith(("embed.", "lm_head.")):
            embeddings.append(p)
        else:
            matrices.append(p)
    return ParamGroups(embeddings, vectors, matrices)
