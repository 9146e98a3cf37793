"""QuaRot-style Hadamard rotation of a trained LM, exact in full precision.

Why: a rotation x ↦ xQ by an orthonormal Hadamard spreads a few large outlier channels over all
channels, so per-token absmax scales (W4A4 RTN, paper.md §5) waste far fewer levels. The rotated FP
model computes the same function; only its quantized version changes. QuaRot: Ashkboos et al. 2024,
arXiv 2404.00456 (Ashkboos is an author of the paper studied here, arXiv 2509.23500).

Notation: W is torch's (out, in) layout and y = x·Wᵀ, so a rotation of a linear's *input* is W → W·R
and a rotation of its *output* is W → Rᵀ·W. Q is the residual-stream rotation (D×D), H_D and H_F the
online Hadamards before o_proj (width D) and down_proj (MLP width F). Every R here is diag(s)·blockdiag
(H_b, …, H_b): s = ±1 signs (all +1 unless kind="random"), b the largest power of two dividing the width.

Llama (pre-norm), as in QuaRot: fold each RMSNorm gain into the columns of the linears that read it and
the final gain into the (untied) head; then E → E·Q, q/k/v/gate/up W → W·Q, o_proj W → Qᵀ·W·H_D,
down_proj W → Qᵀ·W·H_F, head W → W·Q. RMS is rotation-invariant, so gainless norms commute with Q.

OLMo2 (post-sublayer norm, x ← x + RMSNorm_g(f(x)), no pre-norm): q/k/v/up read the rotated residual,
W → W·Q. Their outputs are not rotated (QK-norm needs q, k in the head basis). o_proj and down_proj
keep their outputs in the original basis (W → W·H_D, W → W·H_F): the gain g sits between them and the
residual and does not commute with Q, so the post-norm becomes RMSNorm_g(u)·Q — the original norm followed
by an online Q (`RotatedNorm`). That FP step is inherent to post-norm: one structured D×D rotation per
sublayer, n·(b1+b2) multiply-adds per token (OnlineHadamard), 1/8 of q_proj's D² at D=2048. Final gain
and Q fold into the head: W_h → W_h·diag(g)·Q.

Attention: one full (block) Hadamard H_D before o_proj on the concatenated heads. For power-of-two H
and Dh this equals QuaRot's per-head H_Dh folded into v_proj plus its online cross-head H_H
(H_H ⊗ H_Dh = H_D), so o_proj sees the same input; QuaRot splits it only to also rotate the KV cache,
which is not quantized here.

Online rotations (`OnlineHadamard`) are not nn.Linear, so PTQ (which quantizes every nn.Linear input)
leaves them in FP; `Rotated(rot, linear)` keeps the original nn.Linear as `.linear`.
Left out on purpose: the KV-cache/query rotations of QuaRot (no KV quantization here), learned
rotations (SpinQuant), and a Python FWHT butterfly (a factored matmul is faster on CPU; dependencies.md §2).
"""

from __future__ import annotations

import copy
import logging
from typing import Literal

import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.model import LM, Attention, Residual
from optquant.quant.hadamard import hadamard, largest_pow2_divisor

log = logging.getLogger(__name__)

RotationKind = Literal["none", "hadamard", "random"]  # PTQConfig.rotation is quant/choices.py's Rotation


class OnlineHadamard(nn.Module):
    """x ↦ x·R, R = diag(s)·blockdiag(H_b, …, H_b) orthonormal, without forming R.

    The Sylvester H_b factors as H_b1 ⊗ H_b2 (b2 ≤ max_factor), so a token costs n·(b1 + b2)
    multiply-adds instead of n·b (and O(b1² + b2²) memory instead of O(n²)).
    """

    def __init__(self, n: int, signs: Tensor | None = None, max_factor: int = 256):
        super().__init__()
        self.n, self.block = n, largest_pow2_divisor(n)
        b2 = min(self.block, max_factor)
        # float64 so that weights fold against the exact R; cast to the activation dtype on use.
        # clone: hadamard() returns a cached tensor, which must not become a shared, mutable buffer
        self.register_buffer("h1", hadamard(self.block // b2, torch.float64).clone())
        self.register_buffer("h2", hadamard(b2, torch.float64).clone())
        self.register_buffer("signs", None if signs is None else signs.to(torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.signs is not None:
            x = x * self.signs.to(x.dtype)
        b1, b2 = self.h1.shape[0], self.h2.shape[0]
        y = x.reshape(*x.shape[:-1], self.n // self.block, b1, b2) @ self.h2.to(x.dtype)
        if b1 > 1:  # (H_b1 ⊗ H_b2) acting on the row vector = H_b1ᵀ · X · H_b2 on X of shape (b1, b2)
            y = self.h1.mT.to(x.dtype) @ y
        return y.reshape(x.shape)

    def matrix(self) -> Tensor:
        """R as a dense float64 (n, n) tensor, for folding into weights."""
        Hb = torch.kron(self.h1.double(), self.h2.double())
        R = torch.block_diag(*[Hb] * (self.n // self.block))
        return R if self.signs is None else self.signs.double()[:, None] * R

    def extra_repr(self) -> str:
        return f"n={self.n}, block={self.block}, random={self.signs is not None}"


class Rotated(nn.Module):
    """linear(x·R): an online rotation before a linear whose weight has absorbed R (W → W·R)."""

    def __init__(self, rot: OnlineHadamard, linear: nn.Linear):
        super().__init__()
        self.rot, self.linear = rot, linear

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.rot(x))


class RotatedNorm(nn.Module):
    """norm(u)·Q: OLMo2's post-sublayer RMSNorm, then the residual rotation Q (FP, online)."""

    def __init__(self, norm: nn.RMSNorm, rot: OnlineHadamard):
        super().__init__()
        self.norm, self.rot = norm, rot

    def forward(self, x: Tensor) -> Tensor:
        return self.rot(self.norm(x))


def make_rotation(
    n: int, kind: RotationKind = "hadamard", generator: torch.Generator | None = None
) -> OnlineHadamard:
    """An orthonormal block Hadamard of width n; kind="random" flips row signs (seeded by `generator`)."""
    if kind not in ("hadamard", "random"):
        raise OptquantError(f"rotation kind must be 'hadamard' or 'random', got {kind!r}")
    b = largest_pow2_divisor(n)
    if b < 16:
        log.warning("width %d has Hadamard block %d: outliers spread over only %d channels", n, b, b)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1 if kind == "random" else None
    return OnlineHadamard(n, signs)


@torch.no_grad()
def _fold_(module: nn.Linear | nn.Embedding, left: Tensor | None = None, right: Tensor | None = None) -> None:
    """W ← left·W·right, computed in float64 and cast back once."""
    W = module.weight.detach().double()
    if left is not None:
        W = left.to(W.device, torch.float64) @ W
    if right is not None:
        W = W @ right.to(W.device, torch.float64)
    module.weight.copy_(W.to(module.weight.dtype))


def _is_attention(inner: nn.Module) -> bool:
    """Attention (ours, or an HF one seen through optquant.hf.adapter: same q/k/v/o_proj names) or MLP."""
    return isinstance(inner, Attention) or hasattr(inner, "o_proj")


def _output_linear(residual: Residual) -> nn.Linear:
    """o_proj or down_proj (unwrapped if it already has an online rotation)."""
    inner = residual.inner
    out = inner.o_proj if _is_attention(inner) else inner.down_proj
    return out.linear if isinstance(out, Rotated) else out


def _input_linears(residual: Residual) -> list[nn.Linear]:
    """The linears that read the sublayer's input (the residual stream, or its pre-norm)."""
    inner = residual.inner
    gate = [inner.gate_proj] if hasattr(inner, "gate_proj") else []  # SwiGLU's, or gated attention's
    return [inner.q_proj, inner.k_proj, inner.v_proj, *gate] if _is_attention(inner) else [inner.up_proj, *gate]


@torch.no_grad()
def untie_head_(model: LM) -> None:
    """Give lm_head its own weight: the head absorbs the final norm gain and Q, the embedding does not."""
    if model.lm_head.weight is model.embed.weight:
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())


@torch.no_grad()
def fuse_norms_(model: LM) -> None:
    """Fold RMSNorm gains into the linears that read them, then set the gains to 1.

    Pre-norm (llama): every sublayer norm → its input linears. Both archs: final norm → lm_head
    (untie first). OLMo2's post-sublayer gains have no linear after them and stay (see RotatedNorm).
    """
    if model.lm_head.weight is model.embed.weight:
        raise OptquantError("fuse_norms_ needs an untied head: call untie_head_(model) first")
    norms = [(model.norm, [model.lm_head])]
    norms += [(s.norm, _input_linears(s)) for s in model.sublayers() if not s.post_norm and s.norm is not None]
    for norm, linears in norms:
        g = norm.weight.detach().double()
        for linear in linears:
            _fold_(linear, right=torch.diag(g))
        norm.weight.fill_(1.0)


def rotate_embedding_(model: LM, Q: Tensor) -> None:
    """E → E·Q: the residual stream starts rotated."""
    _fold_(model.embed, right=Q)


def rotate_head_(model: LM, Q: Tensor) -> None:
    """W_h → W_h·Q (the final norm is gainless by now, and RMS is rotation-invariant)."""
    _fold_(model.lm_head, right=Q)


def rotate_inputs_(residual: Residual, Q: Tensor) -> None:
    """q/k/v (attention) or up/gate (MLP) read the rotated stream: W → W·Q. Their outputs (heads, QK-norm,
    RoPE) stay put."""
    for linear in _input_linears(residual):
        _fold_(linear, right=Q)


def online_hadamard_(parent: nn.Module, name: str, rot: OnlineHadamard) -> Rotated:
    """Replace parent.<name> (an nn.Linear) by Rotated(rot, linear) with W → W·R: same function,
    the linear's input becomes x·R."""
    linear = getattr(parent, name)
    if not isinstance(linear, nn.Linear) or linear.in_features != rot.n:
        raise OptquantError(f"online_hadamard_: {name} is not an nn.Linear with {rot.n} inputs")
    _fold_(linear, right=rot.matrix())
    wrapped = Rotated(rot.to(linear.weight.device), linear)
    setattr(parent, name, wrapped)
    return wrapped


def rotate_sublayer_output_(residual: Residual, rot_q: OnlineHadamard) -> None:
    """Make the sublayer add into the rotated stream.

    Pre-norm: the output linear absorbs Qᵀ (W → Qᵀ·W). Post-norm: the gain g does not commute with Q,
    so the norm's output is rotated online (RotatedNorm), and the output linear is left alone.
    """
    if residual.post_norm:
        residual.norm = RotatedNorm(residual.norm, rot_q.to(residual.norm.weight.device))
    else:
        _fold_(_output_linear(residual), left=rot_q.matrix().T)


def rotate_model_(model: LM, kind: RotationKind = "hadamard", seed: int = 0) -> LM:
    """Rotate `model` in place (QuaRot-style; see the module docstring). Same FP logits up to rounding.

    kind="random" draws the residual rotation's signs from `seed`; the online Hadamards before
    o_proj/down_proj are plain in both kinds (as in QuaRot). kind="none" returns the model unchanged.
    The head is untied from the embedding (model.cfg.tie_embeddings is not updated).
    """
    if kind == "none":
        return model
    if any(isinstance(m, Rotated | RotatedNorm) for m in model.modules()):
        raise OptquantError("model is already rotated")
    if torch.is_autocast_enabled(model.embed.weight.device.type):
        # autocast caches its casts of the weights until the region exits: in-place edits go unseen
        raise OptquantError("call rotate_model_ outside torch.autocast (cached weight casts would go stale)")
    generator = torch.Generator().manual_seed(seed)
    # one Q for the whole stream; OLMo2 sublayers get deep copies (shared tensors break safetensors)
    rot_q = make_rotation(model.cfg.d_model, kind, generator)
    Q = rot_q.matrix()
    untie_head_(model)
    fuse_norms_(model)
    rotate_embedding_(model, Q)
    rotate_head_(model, Q)
    for sub in model.sublayers():  # attention, MLP, attention, ...
        out = "o_proj" if _is_attention(sub.inner) else "down_proj"
        rotate_inputs_(sub, Q)
        online_hadamard_(sub.inner, out, make_rotation(getattr(sub.inner, out).in_features))
        rotate_sublayer_output_(sub, copy.deepcopy(rot_q))
    log.info("rotated %s model: kind=%s, D=%d (block %d)", model.cfg.arch, kind, rot_q.n, rot_q.block)
    return model
