"""The paper's OLMo2-style decoder and a Llama-style variant, with size presets.

Notation: B batch, T time (tokens), D width (d_model), H query heads, K key/value heads, Dh head width,
V vocabulary.

OLMo2 variant, as in the authors' code (paper.md §2.1): no biases; RoPE (base 1024); QK-norm is L2
normalisation of q and k per head with a learnable per-head logit scale initialised to √Dh (no further
1/√Dh); each sublayer's *output* is RMS-normalised before the residual add ("reordered norm"); a final
RMSNorm; ReLU² MLP with 4× expansion; input embedding tied to the LM head; every weight ~ N(0, 0.02).

Llama variant (for the generality reviewers asked for): pre-norm, SwiGLU, standard 1/√Dh attention
without QK-norm, optionally untied head.

The network is a chain of residual sublayers (`model.sublayers()`): each maps the residual stream to
the residual stream, including its own norm and residual add. The ABC analysis walks this chain.
Left out on purpose: dropout, biases, z-loss, μP (the paper uses none of them).

Options from Outlier-Safe Pre-Training (OSP; Park et al. 2025, arXiv 2506.19697, code
dmis-lab/Outlier-Safe-Pre-Training, example_modeling_flax.py), both off by default (so every run id stays):
- `norm="single"`: SSNorm, every RMSNorm (the sublayers' and the final one) with one learnable scalar gain
  g (init 1) instead of a per-channel one, y = g · x/√(mean x² + ε), as their Flax nn.RMSNorm(feature_axes=()).
  The OLMo2 QK-norm (L2 with a per-head scale) is not an RMSNorm and stays.
- `embed_proj=True`: EmbProj, two learned D×D projections, orthogonally initialised: x = P_in e(idx) after
  the embedding, logits = head(P_out · norm(x)) before the head (their rot1, rot2). They sit inside
  `embed` and `norm`, so every walk of the chain sees them; they are not nn.Linear, so PTQ leaves them in
  FP, as the merged inference model (P_in folded into the embedding, P_out into the head) has no such
  layer; in the optimizer groups they are matrices (Muon's, as OSP trains them). Their Flax layers carry
  a bias (DenseGeneral's default); ours are bias-free, as the rest of this model.

Architecture options against outliers (issue 32), both off by default (every run id stays):
- `block="op"`: the Outlier Protected block of He et al. 2024 (arXiv 2405.19279, §4, Fig. 3), from the paper's
  text (no reference code was found): no norm inside the block (neither llama's pre-norms nor OLMo2's
  post-sublayer norms), each sublayer x + β·f(x) with a learnable scalar β per branch (the downweighted
  residual; initialised to 1/√(2·n_layer), the 1/√depth of signal propagation over the 2·n_layer branches:
  the paper gives no number we could check), and QK-norm as the entropy regulation (OLMo2's, switched on for
  llama too). The final norm before the head is kept; the paper's optional MLP input scaling is left out.
- `attn_gate=True`: gated attention (Qiu et al. 2025, Qwen, arXiv 2505.06708, the G1 position): the SDPA
  output, heads concatenated, is multiplied elementwise by σ(x·W_gᵀ) before o_proj, x the attention's input
  (what q/k/v read) and W_g a D×D `gate_proj` (a head-specific, elementwise gate; an nn.Linear, so PTQ
  quantizes it like q_proj, into which Qwen3-Next fuses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from msgspec import Meta
from torch import Tensor, nn

from optquant.ranges import Count, Positive


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["olmo2", "llama"] = "olmo2"
    vocab_size: Annotated[int, Meta(ge=257, le=2**31 - 1)] = 4096
    n_layer: Count = 2
    d_model: Count = 128
    n_head: Count = 4
    n_kv_head: Count = 4  # GQA: n_head must be a multiple of n_kv_head
    mlp_ratio: Count = 4  # hidden = mlp_ratio * d_model (olmo2); llama uses 2/3 of it, rounded to 128
    seq_len: Annotated[int, Meta(ge=2)] = 128
    rope_base: Positive = 1024.0
    tie_embeddings: bool = True
    init_std: Positive = 0.02
    norm: Literal["rms", "single"] = "rms"  # "single": OSP's single-scale RMSNorm (module docstring)
    embed_proj: bool = False  # OSP's learned embedding projections (module docstring)
    block: Literal["standard", "op"] = "standard"  # "op": He et al.'s Outlier Protected block (module docstring)
    attn_gate: bool = False  # Qwen's gated attention: σ(x W_gᵀ) ⊙ SDPA output before o_proj (module docstring)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.arch == "olmo2":
            return self.mlp_ratio * self.d_model
        return max(128, round(self.mlp_ratio * self.d_model * 2 / 3 / 128) * 128)

    def validate(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head={self.n_head} is not a multiple of "
                             f"model.n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head width {self.head_dim} must be even for RoPE")


class SingleScaleRMSNorm(nn.Module):
    """OSP's SSNorm: y = g · x/√(mean x² + ε) over the last dimension, one learnable scalar g (init 1);
    ε as nn.RMSNorm's default (the dtype's machine epsilon)."""

    def __init__(self, eps: float | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, x.shape[-1:], eps=self.eps) * self.weight


class Projection(nn.Module):
    """OSP's EmbProj half: x ↦ P x, P a learned D×D matrix, orthogonal at init (not an nn.Linear: PTQ
    leaves it in FP, as merged into the embedding or head)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(nn.init.orthogonal_(torch.empty(d, d)))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class ProjectedEmbedding(nn.Embedding):
    """The embedding followed by EmbProj's input projection (its weight is still the table, for tying)."""

    def __init__(self, vocab: int, d: int):
        super().__init__(vocab, d)
        self.proj = Projection(d)

    def forward(self, idx: Tensor) -> Tensor:
        return self.proj(super().forward(idx))


def make_norm(cfg: ModelConfig) -> nn.Module:
    return SingleScaleRMSNorm() if cfg.norm == "single" else nn.RMSNorm(cfg.d_model)  # torch default eps


# Size presets. Widths are multiples of 128 for the paper sizes, so every linear input dimension
# (D and the MLP hidden width) admits the 128-block Hadamard of QuEST. Counts are in the README.
MODEL_PRESETS: dict[str, dict] = {
    # The default CPU study's four sizes (study_spec.py's `cpu`): depth and width grow together, as in the
    # paper's family, so that quantization error has blocks to propagate through (≥ 2 everywhere, 4 at the
    # largest) while a run stays seconds long. With the study's 1024-token vocabulary: 1.6k, 3.5k, 9.3k and
    # 27.9k non-embedding parameters (a 17× span in the N the fits count), the tied embedding 84 % of the
    # smallest model and 47 % of the largest.
    "zepto": dict(n_layer=2, d_model=8, n_head=2, n_kv_head=2, seq_len=64),
    "atto": dict(n_layer=2, d_model=12, n_head=2, n_kv_head=2, seq_len=64),
    "femto": dict(n_layer=3, d_model=16, n_head=2, n_kv_head=2, seq_len=64),
    "pico": dict(n_layer=4, d_model=24, n_head=2, n_kv_head=2, seq_len=64),
    "nano": dict(n_layer=2, d_model=48, n_head=2, n_kv_head=2, seq_len=64),
    "micro": dict(n_layer=2, d_model=64, n_head=2, n_kv_head=2, seq_len=64),
    "tiny": dict(n_layer=4, d_model=128, n_head=2, n_kv_head=2, seq_len=128),
    "small": dict(n_layer=4, d_model=256, n_head=4, n_kv_head=4, seq_len=128),
    "50m": dict(n_layer=10, d_model=512, n_head=8, n_kv_head=8, seq_len=1024, vocab_size=32000),
    "125m": dict(n_layer=14, d_model=768, n_head=12, n_kv_head=12, seq_len=1024, vocab_size=32000),
    "350m": dict(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, seq_len=1024, vocab_size=32000),
    "500m": dict(n_layer=24, d_model=1280, n_head=10, n_kv_head=10, seq_len=1024, vocab_size=32000),
    "760m": dict(n_layer=24, d_model=1536, n_head=12, n_kv_head=12, seq_len=1024, vocab_size=32000),
    "1.5b": dict(n_layer=28, d_model=2048, n_head=16, n_kv_head=16, seq_len=1024, vocab_size=32000),
}


def model_config(preset: str, **overrides) -> ModelConfig:
    """The ModelConfig of a size preset, with field overrides."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return ModelConfig(**{**MODEL_PRESETS[preset], **overrides})


def rope_cache(seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (T, Dh/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles. x: (B, H, T, Dh)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention with GQA; QK-norm with a learnable per-head scale for olmo2."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        kv_dim = cfg.n_kv_head * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        if cfg.attn_gate:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.qk_norm = cfg.arch == "olmo2" or cfg.block == "op"
        if self.qk_norm:
            self.qk_scale = nn.Parameter(torch.full((1, cfg.n_head, 1, 1), math.sqrt(cfg.head_dim)))
        cos, sin = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, Dh)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.qk_norm:  # the logit scale is qk_scale: no further 1/√Dh
            q = F.normalize(q, dim=-1) * self.qk_scale.to(q.dtype)
            k = F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 if self.qk_norm else None,
                                           enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, D)
        if hasattr(self, "gate_proj"):
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)


class MLP(nn.Module):
    """ReLU² (olmo2) or SwiGLU (llama)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch == "llama"
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        if self.gated:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.relu(self.up_proj(x)).square())


class Residual(nn.Module):
    """One residual sublayer: x + norm(f(x)) (olmo2, post-sublayer norm) or x + f(norm(x)) (llama), or
    x + β·f(x) in the OP block (no norm: `norm` is None)."""

    def __init__(self, inner: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.inner = inner
        op = cfg.block == "op"
        self.norm = None if op else make_norm(cfg)  # torch default eps, as the authors
        self.post_norm = cfg.arch == "olmo2" and not op
        if op:
            self.beta = nn.Parameter(torch.tensor(1 / math.sqrt(2 * cfg.n_layer)))

    def forward(self, x: Tensor) -> Tensor:
        if self.norm is None:
            return x + self.beta * self.inner(x)
        if self.post_norm:
            return x + self.norm(self.inner(x))
        return x + self.inner(self.norm(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Residual(Attention(cfg), cfg)
        self.mlp = Residual(MLP(cfg), cfg)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.attn(x))


class LM(nn.Module):
    """Decoder-only language model. forward(idx (B, T) int64) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = ProjectedEmbedding(cfg.vocab_size, cfg.d_model) if cfg.embed_proj else \
            nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg)  # torch default eps, as the authors
        if cfg.embed_proj:  # P_out between the final norm and the head
            self.norm = nn.Sequential(self.norm, Projection(cfg.d_model))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)

    def sublayers(self) -> list[nn.Module]:
        """The residual sublayers in forward order (attention, MLP, attention, MLP, ...)."""
        return [sub for block in self.blocks for sub in (block.attn, block.mlp)]

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head: residual stream (B, T, D) -> logits (B, T, V)."""
        return self.lm_head(self.norm(x))

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def count_params(model: LM, embeddings: bool = True) -> int:
    """Parameters, counting a tied embedding once; embeddings=False drops the embedding and head."""
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    if not embeddings:
        n -= model.embed.weight.numel()
        if model.lm_head.weight is not model.embed.weight:
            n -= model.lm_head.weight.numel()
    return n


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean next-token cross-entropy; logits are upcast to fp32 for the softmax."""
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
