"""Scion, unconstrained (Pethick et al. 2025, arXiv 2502.07529): momentum, then a norm's LMO per group.

`pytorch_optimizer.SCION` (measured faithful to LIONS-EPFL/scion, dependencies.md §1.2) with three groups,
as the authors called it (paper.md §3), all with Scion's α = 1 − β (d ← (1−α)·d + α·g), decoupled weight
decay, scale 1 and `constraint=False` passed explicitly (the library's and the reference's flags of that
name mean opposite things):
- hidden matrices: spectral LMO, W ← W − lr·√(d_out/d_in)·NS5(d);
- embedding (= tied head): sign LMO, W ← W − lr_emb·sign(d)/d_in with lr_emb = 1 (or, with
  `embed_lr_ratio` > 0, lr_emb = embed_lr_ratio × lr: tied to the LR search, as `vector_lr_ratio` ties lr_vec);
- vectors (RMSNorm gains, QK scales): lr_vec = 3e-3 with `norm_type=8`, an LMO defined only in the
  authors' fork ("Scion correction for learnable gains"), which is not retrievable. Upstream the type
  falls back to the identity (momentum SGD, which at lr 3e-3 barely moves a gain); the library's sign LMO
  cannot take a 1-D tensor (it divides by size(1)). Our default, `vector_lmo="sign"`, is the LMO of the
  ℓ∞ ball, sign(d) unscaled: a gain g acts as diag(g), whose RMS→RMS operator norm is max|gᵢ|, so this
  is Scion's own rule applied to gains, and at 3e-3 it moves a gain as far per step as the Muon runs'
  AdamW does. "identity" reproduces upstream `norm_type=8`; "rms" is the library's bias LMO g/rms(g).

The spectral LMO's Newton–Schulz runs in `ns_dtype` (optim/newton_schulz.py, shared with Muon): in "bf16",
the library's choice, our step is bitwise the library's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pytorch_optimizer import SCION
from pytorch_optimizer.optimizer.scion import LMONorm, Norm, Spectral

from optquant.optim.groups import LRGroup, ParamGroups
from optquant.optim.newton_schulz import DTYPES, newton_schulz, newton_schulz_many, resolve_ns_dtype, set_ns_dtype_
from optquant.ranges import Count, NonNegative, Positive, Probability

GAIN_SIGN = 8  # the authors' norm_type for the vector group


class GainSign(Norm):
    """LMO of the ℓ∞ ball for gains: sign(d), any shape."""

    def lmo(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.sign(grad)


class NewtonSchulzSpectral(Spectral):
    """The library's spectral LMO, NS(d)·√(d_out/d_in), with Newton–Schulz in `dtype`; same-shape matrices
    are orthogonalised as one stack, as the library does."""

    def __init__(self, spectral: Spectral, dtype: torch.dtype):
        super().__init__(max_scale=spectral.max_scale, normalize=spectral.normalize, num_steps=spectral.num_steps)
        self.dtype = dtype

    def _scale(self, shape: torch.Size) -> float:
        scale = math.sqrt(shape[0] / shape[1]) if self.normalize else math.sqrt(shape[0])
        return max(1.0, scale) if self.max_scale else scale

    def _orthogonalize(self, g: torch.Tensor) -> torch.Tensor:
        return newton_schulz(g, self.num_steps, self.dtype, memory_format=torch.contiguous_format)

    def lmo(self, grad: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        # not lmo_foreach([grad]): in bf16, mul_ by a float rounds unlike _foreach_mul_ (each path is the library's)
        return self._orthogonalize(grad.view(len(grad), -1)).view(grad.shape).mul_(self._scale(grad.shape))

    def lmo_foreach(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        mats = [g.reshape(g.size(0), -1) for g in grads]
        updates = newton_schulz_many(mats, self.num_steps, self.dtype, memory_format=torch.contiguous_format)
        updates = [u.reshape(g.shape) for u, g in zip(updates, grads, strict=True)]
        torch._foreach_mul_(updates, [self._scale(g.shape) for g in grads])
        return updates


class Scion(SCION):
    """`pytorch_optimizer.SCION` where `norm_type=8` means `GainSign` and the spectral LMO's Newton–Schulz
    runs in the group's `ns_dtype`."""

    def __init__(self, params, ns_dtype: Literal["bf16", "fp32"] = "bf16", **kwargs):
        super().__init__(params, **kwargs)
        set_ns_dtype_(self, ns_dtype)

    def _norm(self, group, norm: Norm) -> Norm:
        if group["norm_type"] == GAIN_SIGN:
            return GainSign()
        if isinstance(norm, Spectral):
            return NewtonSchulzSpectral(norm, DTYPES[group.setdefault("ns_dtype", self.defaults["ns_dtype"])])
        return norm

    def _step_foreach(self, group, params, grads, norm, ds):
        return super()._step_foreach(group, params, grads, self._norm(group, norm), ds)

    def _step_per_param(self, group, norm):
        return super()._step_per_param(group, self._norm(group, norm))


_VECTOR_NORM = {"sign": GAIN_SIGN, "identity": int(LMONorm.NONE), "rms": int(LMONorm.BIAS)}


@dataclass(frozen=True)
class ScionConfig:
    """Defaults: the authors' groups and learning rates; lr is the Scion paper's nanoGPT hidden setting
    (lr 2⁻¹² at radius 50, folded into lr because the authors use scale 1)."""

    name: Literal["scion"] = "scion"
    lr: Positive = 50 * 2**-12  # hidden matrices (the swept lr)
    momentum: Probability = 0.1  # Scion's α = 1 − β, the authors' 1 − 0.9
    embed_lr: Positive = 1.0  # the authors' fixed step sizes, used while the matching ratio is 0
    vector_lr: Positive = 3e-3
    embed_lr_ratio: NonNegative = 0.0  # > 0: the embedding's step size is embed_lr_ratio × lr (tied to the LR search)
    vector_lr_ratio: NonNegative = 0.0  # > 0: the vectors' step size is vector_lr_ratio × lr
    vector_lmo: Literal["sign", "identity", "rms"] = "sign"
    weight_decay: NonNegative = 0.0  # decoupled
    constraint: bool = False  # True: Frank–Wolfe W ← (1−lr)·W − lr·LMO(d), the constrained variant
    scale: Positive = 1.0  # radius multiplying every LMO
    ns_steps: Count = 5
    ns_dtype: Literal["auto", "bf16", "fp32"] = "auto"  # Newton–Schulz; bf16 = the library's; auto = as precision

    # group step sizes a study can tie to lr and search: label -> (fixed field, ratio field)
    GROUP_LRS: ClassVar[dict[str, tuple[str, str]]] = {"embedding": ("embed_lr", "embed_lr_ratio"),
                                                        "vectors": ("vector_lr", "vector_lr_ratio")}

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
        """pytorch_optimizer.SCION's one momentum buffer `d` per parameter, like the parameter."""
        return math.prod(shape) * element_size

    def lr_groups(self) -> list[LRGroup]:
        e, v = self.embed_lr_ratio, self.vector_lr_ratio  # > 0: tied to lr
        return [LRGroup(("embeddings",), e * self.lr if e > 0 else self.embed_lr, e > 0, "embed_lr_ratio"),
                LRGroup(("vectors",), v * self.lr if v > 0 else self.vector_lr, v > 0, "vector_lr_ratio"),
                LRGroup(("matrices",), self.lr)]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        embed_lr, vector_lr, _ = (g.lr for g in self.lr_groups())
        spec = [
            (groups.embeddings, embed_lr, int(LMONorm.SIGN), {}),
            (groups.vectors, vector_lr, _VECTOR_NORM[self.vector_lmo], {}),
            (groups.matrices, self.lr, int(LMONorm.SPECTRAL), {"num_steps": self.ns_steps}),
        ]
        params = [
            {"params": p, "lr": lr, "norm_type": norm, "norm_kwargs": kwargs} for p, lr, norm, kwargs in spec if p
        ]
        return [
            Scion(
                params,
                ns_dtype=resolve_ns_dtype(self.ns_dtype, groups.all()),
                lr=self.lr,
                momentum=self.momentum,
                constraint=self.constraint,
                scale=self.scale,
                weight_decay=self.weight_decay,
                weight_decouple=True,
            )
        ]
