"""Shampoo with Adam grafting, following Meta's DistributedShampoo as the paper ran it (paper.md §3).

Shampoo: Gupta, Koren, Singer 2018 (arXiv 1802.09568); the implementation the paper used: Shi et al. 2023
(arXiv 2309.06497), facebookresearch/optimizers `DistributedShampoo` as of mid-2025, called as
`DistributedShampoo(betas=(β1, β2), epsilon=ε, use_decoupled_weight_decay=True,
grafting_config=AdamGraftingConfig(β2, ε), precondition_frequency=20, max_preconditioner_dim=12288,
start_preconditioning_step=-1, use_bias_correction=True)`, every other option at its default (root-inverse
preconditioner by eigendecomposition, `momentum=0`, fp32 factors). Its semantics were read from that
source (no code copied) and checked step for step against it outside this repository. `Shampoo` keeps
DistributedShampoo's argument names; the config calls the cap `max_precondition_dim`, as PSGD's and SOAP's do.

One step t of one parameter W with gradient G (factors are fp32, like the parameters):
1. Blocks: size-1 dims are squeezed (a (1, H, 1, 1) QK scale becomes (H,)), then every dim is split into
   chunks of at most `max_preconditioner_dim`; each block is preconditioned on its own.
2. Factors, every step, for each dim k of a block: F_k ← β2·F_k + (1−β2)·G_(k)·G_(k)ᵀ, where G_(k) is the
   block with dim k first and the other dims flattened. Adam's grafting state: V ← β2·V + (1−β2)·G².
   β2 = 1 means Adagrad: both become plain sums (weight 1 on the new term) and take no bias correction,
   as in DistributedShampoo (2025-06), whose Adam grafting at β2 = 1 is Adagrad grafting.
3. Inverse roots at t = s and at every t > s with t % f = 0 (f = precondition frequency; s = start step,
   -1 meaning s = f): X_k = (F_k/(1−β2^t) + εI)^(−1/(2·order)) by `eigh` — L^(−1/4)·G·R^(−1/4) for
   matrices, full-matrix L^(−1/2)·g for vectors. If fp32 `eigh` fails it is retried in fp64 (counted);
   if eigenvalues come out below ε they are shifted up so the smallest is ε (DistributedShampoo's rule).
   If fp64 fails too, the previous root is kept; more than 3 consecutive failures raise. Roots start at I.
4. Filtered gradient (β1 is "momentum" in the authors' CLI): M ← β1·M + (1−β1)·G, M̂ = M/(1−β1^t).
5. Direction: while t < s it is Adam's, A = M̂/(√(V/(1−β2^t)) + ε), so the first s−1 steps are exactly
   Adam. From t = s on, P = M̂ ×₁ X₁ ··· ×ₖ Xₖ, rescaled per block to Adam's norm, P·‖A‖/(‖P‖ + 1e-16):
   Shampoo's direction with Adam's step size ("grafting"). Without grafting, P = M̂ before the first roots.
6. P ← P + λ·W (decoupled weight decay), then heavy-ball momentum B ← μ·B + P, P ← B when μ > 0.
7. W ← W − lr·P.

Left out on purpose: distributed state sharding (every rank computes everything, as replicated DDP),
torch.compile, the other preconditioners (eigenvalue-corrected, Newton roots), Nesterov/dampening/β3,
coupled L2 decay, and DistributedShampoo's merging of adjacent small dims. That merge only squeezes
size-1 dims on every tensor of the paper's models (all their 2-D weights exceed 12288 entries); on toy
widths it would flatten e.g. a 64×64 matrix into a 4096-vector with a 4096² factor, so we only squeeze.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
from msgspec import Meta
from torch import Tensor

from optquant.errors import OptquantError
from optquant.optim.groups import LRGroup, ParamGroups, closure_loss, dense_params
from optquant.ranges import Count, NonNegative, Positive, Unit

log = logging.getLogger(__name__)
MAX_FAILED_ROOTS = 3  # DistributedShampoo's num_tolerated_failed_amortized_computations


# ----------------------------------------------------------------------------------- pure functions
def block_views(t: Tensor, max_dim: int) -> list[Tensor]:
    """Views of `t` with size-1 dims squeezed, split into chunks of at most `max_dim` along every dim."""
    shape = [d for d in t.shape if d != 1] or [1]
    blocks = [t.reshape(shape)]
    for dim in range(len(shape)):
        blocks = [piece for b in blocks for piece in torch.split(b, max_dim, dim=dim)]
    return blocks


def shampoo_blocks(shape: tuple[int, ...], max_dim: int) -> list[tuple[int, ...]]:
    """The block shapes of `block_views`, from the shape alone (for the planner's state bytes): its views of a
    meta tensor, which holds no data."""
    return [tuple(b.shape) for b in block_views(torch.empty(shape, device="meta"), max_dim)]


def update_factors_(factors: list[Tensor], g: Tensor, beta2: float) -> None:
    """F_k ← β2·F_k + (1−β2)·G_(k)G_(k)ᵀ for each dim k (β2 = 1: plain sum, as Adagrad)."""
    for k, F in enumerate(factors):
        rest = [i for i in range(g.ndim) if i != k]
        outer = torch.tensordot(g, g, dims=(rest, rest))
        if beta2 == 1.0:
            F.add_(outer)
        else:
            F.mul_(beta2).add_(outer, alpha=1 - beta2)


def update_graft_(v: Tensor, g: Tensor, beta2: float) -> None:
    """Adam's grafting second moment V ← β2·V + (1−β2)·G² (β2 = 1: plain sum, Adagrad grafting)."""
    if beta2 == 1.0:
        v.addcmul_(g, g)
    else:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def inverse_root(A: Tensor, root: float, eps: float) -> tuple[Tensor, bool]:
    """(A + εI)^(−1/root) by eigendecomposition; returns (X, retried_in_fp64)."""
    ridge = A + eps * torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    retried = False
    try:
        L, Q = torch.linalg.eigh(ridge)
    except RuntimeError:
        if ridge.dtype == torch.float64:
            raise
        retried = True
        L, Q = (x.to(A.dtype) for x in torch.linalg.eigh(ridge.double()))
    lam_min = L.min()
    if lam_min < eps:  # rounding made the spectrum non-positive: shift it so its minimum is ε
        L = (L - lam_min) + eps
    return (Q * L.pow(-1.0 / root).unsqueeze(0)) @ Q.T, retried


def precondition(g: Tensor, roots: list[Tensor]) -> Tensor:
    """G ×₁ X₁ ··· ×ₖ Xₖ: contract each dim with its (symmetric) root; dims come back in order."""
    for X in roots:
        g = torch.tensordot(g, X, dims=([0], [0]))
    return g


def adam_direction(m_hat: Tensor, v: Tensor, bc2: float, eps: float) -> Tensor:
    """Adam's step direction M̂/(√(V/(1−β2^t)) + ε)."""
    return m_hat / (v / bc2).sqrt().add_(eps)


def graft(direction: Tensor, reference: Tensor) -> Tensor:
    """`direction` rescaled to the norm of `reference` (Shampoo's direction, Adam's step size)."""
    return direction * (reference.norm() / (direction.norm() + 1e-16))


def refresh_roots_(state: dict, bc2: float, eps: float) -> None:
    """Recompute every inverse root of one parameter from its bias-corrected factors."""
    failed = False
    for factors, roots in zip(state["factors"], state["roots"], strict=True):
        for F, X in zip(factors, roots, strict=True):
            A = F / bc2
            if not torch.isfinite(A).all():
                raise FloatingPointError("non-finite Shampoo factor: the run has diverged (lower the lr)")
            try:
                new, retried = inverse_root(A, 2.0 * len(factors), eps)
            except RuntimeError as err:  # fp64 failed too: keep the previous root, as DistributedShampoo
                log.warning("Shampoo eigh failed in fp64 (%s); keeping the previous root", err)
                failed = True
                continue
            state["eigh_retries"] += int(retried)
            if not torch.isfinite(new).all():
                raise FloatingPointError("non-finite Shampoo inverse root: the run has diverged")
            X.copy_(new)
    state["eigh_failures"] = state["eigh_failures"] + 1 if failed else 0
    if state["eigh_failures"] > MAX_FAILED_ROOTS:
        raise FloatingPointError(f"Shampoo eigh failed {state['eigh_failures']} times in a row")


def shampoo_update(p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor:
    """Steps 2–6 of the module docstring for one parameter; updates `state` in place, returns P."""
    t, (beta1, beta2), eps = state["step"], group["betas"], group["eps"]
    f = group["precondition_frequency"]
    start = f if group["start_preconditioning_step"] == -1 else group["start_preconditioning_step"]
    bc2 = 1 - beta2**t if beta2 < 1 else 1.0
    max_dim = group["max_preconditioner_dim"]
    for factors, g in zip(state["factors"], block_views(grad, max_dim), strict=True):
        update_factors_(factors, g, beta2)
    if "graft_v" in state:
        update_graft_(state["graft_v"], grad, beta2)
    if t == start or (t > start and t % f == 0):
        refresh_roots_(state, bc2, eps)
    m_hat = grad
    if beta1 > 0:
        m_hat = state["filtered_grad"].lerp_(grad, 1 - beta1) / (1 - beta1**t)
    adam = adam_direction(m_hat, state["graft_v"], bc2, eps) if "graft_v" in state else None
    direction = torch.empty(p.shape, dtype=p.dtype, device=p.device)  # contiguous: blocks are views
    views = (block_views(x, max_dim) for x in (direction, m_hat, adam if adam is not None else m_hat))
    for out, m, a, roots in zip(*views, state["roots"], strict=True):  # a is m without grafting
        if not roots or (adam is not None and t < start):  # unpreconditioned 1-D / Adam before the first roots
            out.copy_(a)
        else:
            out.copy_(graft(precondition(m, roots), a) if adam is not None else precondition(m, roots))
    if group["weight_decay"] != 0:
        direction.add_(p, alpha=group["weight_decay"])
    if group["momentum"] > 0:
        direction = state["momentum"].mul_(group["momentum"]).add_(direction)  # read-only for the caller
    return direction


# ------------------------------------------------------------------------------------- optimizer
class Shampoo(torch.optim.Optimizer):
    """Bookkeeping around `shampoo_update`; state holds only tensors and ints, so it checkpoints as is."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        precondition_frequency: int = 20,
        start_preconditioning_step: int = -1,
        max_preconditioner_dim: int = 12288,
        grafting: Literal["adam", "none"] = "adam",
        precondition_1d: bool = True,
    ):
        frequency, start = precondition_frequency, start_preconditioning_step
        if lr < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] <= 1:
            raise OptquantError(f"Shampoo needs lr >= 0, 0 <= beta1 < 1, 0 <= beta2 <= 1; got {lr}, {betas}")
        if eps <= 0 or not 0 <= momentum < 1 or frequency < 1:
            raise OptquantError("Shampoo needs eps > 0, 0 <= momentum < 1 and precondition_frequency >= 1")
        if start != -1 and start < frequency:
            raise OptquantError(f"Shampoo start_preconditioning_step {start} must be -1 or >= {frequency}")
        if grafting not in ("adam", "none"):
            raise OptquantError(f"Shampoo grafting must be 'adam' or 'none', got {grafting!r}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            max_preconditioner_dim=max_preconditioner_dim,
            grafting=grafting,
            precondition_1d=precondition_1d,
        )
        super().__init__(params, defaults)

    @property
    def eigh_retries(self) -> int:
        """How many inverse roots needed the fp64 retry so far (the run summary reports it)."""
        return sum(s.get("eigh_retries", 0) for s in self.state.values())

    @staticmethod
    def _init_state(p: Tensor, group: dict) -> dict:
        state: dict = {"step": 0, "eigh_retries": 0, "eigh_failures": 0, "factors": [], "roots": []}
        squeezed_1d = sum(d != 1 for d in p.shape) <= 1
        for block in block_views(p.detach(), group["max_preconditioner_dim"]):
            use = group["precondition_1d"] or not squeezed_1d
            dims = block.shape if use else ()
            state["factors"].append([p.new_zeros(n, n) for n in dims])
            state["roots"].append([torch.eye(n, dtype=p.dtype, device=p.device) for n in dims])
        if group["betas"][0] > 0:
            state["filtered_grad"] = torch.zeros_like(p)
        if group["grafting"] == "adam":
            state["graft_v"] = torch.zeros_like(p)
        if group["momentum"] > 0:
            state["momentum"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in dense_params(group, "Shampoo"):
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p, group))
                state["step"] += 1
                p.add_(shampoo_update(p, p.grad, state, group), alpha=-group["lr"])
        return loss


@dataclass(frozen=True)
class ShampooConfig:
    """Defaults: the authors' README example (lr 3e-3, β1 0.95, β2 0.95, ε 1e-10) and their call (§3)."""

    name: Literal["shampoo"] = "shampoo"
    lr: Positive = 3e-3
    beta1: float = 0.95  # EMA of the gradient ("filtered gradient"); the authors' --momentum
    beta2: float = 0.95  # EMA of the factors and of Adam's grafting second moment
    eps: Positive = 1e-10  # εI added to the factors and Adam's ε, one value as in the authors' call
    weight_decay: NonNegative = 0.0  # decoupled
    momentum: Unit = 0.0  # heavy-ball on top of the direction; DistributedShampoo's default, unused
    precondition_frequency: Count = 20
    start_preconditioning_step: Annotated[int, Meta(ge=-1)] = -1  # -1: the precondition frequency
    max_precondition_dim: Count = 12288  # DistributedShampoo's max_preconditioner_dim; 8192 in the authors' code
    grafting: Literal["adam", "none"] = "adam"
    precondition_1d: bool = True  # False: vectors take the grafting (Adam) step only

    LEGACY_NAMES: ClassVar[dict[str, str]] = {"max_precondition_dim": "max_preconditioner_dim"}  # in run ids

    def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
        """`Shampoo._init_state`: per block and dim an n×n factor and an n×n root (none for a squeezed 1-D
        parameter unless `precondition_1d`), plus the filtered gradient (β1 > 0), Adam's grafting V
        (grafting="adam") and heavy-ball momentum (momentum > 0), each like the parameter."""
        total = 0
        if self.precondition_1d or sum(d != 1 for d in shape) > 1:
            blocks = shampoo_blocks(shape, self.max_precondition_dim)
            total += sum(2 * n * n * element_size for blk in blocks for n in blk)
        copies = (self.beta1 > 0) + (self.grafting == "adam") + (self.momentum > 0)
        return total + copies * math.prod(shape) * element_size

    def lr_groups(self) -> list[LRGroup]:
        return [LRGroup(("embeddings", "vectors"), self.lr), LRGroup(("matrices",), self.lr)]

    def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
        params = [{"params": g} for g in (groups.embeddings + groups.vectors, groups.matrices) if g]
        return [
            Shampoo(
                params,
                lr=self.lr,
                betas=(self.beta1, self.beta2),
                eps=self.eps,
                weight_decay=self.weight_decay,
                momentum=self.momentum,
                precondition_frequency=self.precondition_frequency,
                start_preconditioning_step=self.start_preconditioning_step,
                max_preconditioner_dim=self.max_precondition_dim,
                grafting=self.grafting,
                precondition_1d=self.precondition_1d,
            )
        ]
