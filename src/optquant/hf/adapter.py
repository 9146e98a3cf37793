"""A Hugging Face causal LM seen as optquant's residual-sublayer chain (the interface of `optquant.model.LM`).

`HFLM` re-arranges the HF model's own modules (nothing is re-implemented or copied) into our layout:
`embed` (the token embedding), `blocks[i].attn` / `blocks[i].mlp` (`HFResidual`: one residual sublayer,
its norm and its add), `norm` (final norm) and `lm_head`, with `sublayers()`, `head(x)` and
`forward(idx) -> logits`. So the outlier metrics, PTQ (RTN/GPTQ), the Hadamard rotation and the ABC
decomposition run on it unchanged, and module names read like ours (`blocks.0.attn.inner.q_proj`).

The sublayer mapping is one small `Family` per architecture: which norm belongs to the attention and
to the MLP sublayer, and whether it is applied before the sublayer (pre-norm: x + f(norm(x)); Llama,
Mistral, Qwen2, Qwen3) or after it (x + norm(f(x)); OLMo2). The attention runs with an explicit
additive causal mask (with the family's sliding window where it has one) and HF's own rotary module,
so the chain computes what HF's forward computes.

Left out on purpose: KV caches, padding masks (every sequence is full length), and families other than
these five (a new one is one `Family` line if its decoder layer is Llama-shaped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.model import LM


@dataclass(frozen=True)
class Family:
    attn_norm: str  # attribute of the HF decoder layer normalizing the attention sublayer
    mlp_norm: str
    post_norm: bool  # True: x + norm(f(x)) (OLMo2); False: x + f(norm(x))
    window: Callable[[object, nn.Module], int | None] = lambda config, attn: None  # sliding window, if any


def _mistral_window(config, attn) -> int | None:
    return getattr(config, "sliding_window", None)


def _qwen_window(config, attn) -> int | None:
    return getattr(attn, "sliding_window", None)  # per layer (layer_types), None for full attention


FAMILIES: dict[str, Family] = {
    "llama": Family("input_layernorm", "post_attention_layernorm", post_norm=False),
    "mistral": Family("input_layernorm", "post_attention_layernorm", post_norm=False, window=_mistral_window),
    "qwen2": Family("input_layernorm", "post_attention_layernorm", post_norm=False, window=_qwen_window),
    "qwen3": Family("input_layernorm", "post_attention_layernorm", post_norm=False, window=_qwen_window),
    "olmo2": Family("post_attention_layernorm", "post_feedforward_layernorm", post_norm=True),
}


@dataclass(frozen=True)
class HFInfo:
    """What the metrics read off `model.cfg` (the fields of optquant's ModelConfig they use)."""

    arch: str  # the HF model_type
    d_model: int
    vocab_size: int
    n_layer: int
    seq_len: int  # the window the analysis uses (at most the model's max_position_embeddings)


def causal_mask(T: int, window: int | None, dtype: torch.dtype, device) -> Tensor:
    """(1, 1, T, T) additive mask: 0 where query i may attend key j (j ≤ i, and i − j < window), else −∞."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class HFResidual(nn.Module):
    """One residual sublayer of an HF decoder layer: x + inner(norm(x)) or x + norm(inner(x))."""

    def __init__(self, inner: nn.Module, norm: nn.Module, post_norm: bool, rotary: nn.Module | None = None,
                 window: int | None = None):
        super().__init__()
        self.inner, self.norm, self.post_norm, self.window = inner, norm, post_norm, window
        self.is_attention = rotary is not None
        object.__setattr__(self, "_rotary", rotary)  # shared with HFLM, not registered twice

    def _f(self, x: Tensor) -> Tensor:
        if not self.is_attention:
            return self.inner(x)
        T = x.shape[1]
        positions = torch.arange(T, device=x.device)[None]
        cos, sin = self._rotary(x, positions)
        mask = causal_mask(T, self.window, x.dtype, x.device)
        return self.inner(x, position_embeddings=(cos, sin), attention_mask=mask)[0]

    def forward(self, x: Tensor) -> Tensor:
        if self.post_norm:
            return x + self.norm(self._f(x))
        return x + self._f(self.norm(x))


class HFLM(nn.Module):
    """An HF causal LM as a chain of residual sublayers. forward(idx (B, T)) -> logits (B, T, V)."""

    def __init__(self, hf_model: nn.Module, seq_len: int = 128):
        super().__init__()
        config = hf_model.config
        family = FAMILIES.get(config.model_type)
        if family is None:
            raise OptquantError(f"Hugging Face model_type {config.model_type!r} is not supported; "
                                f"supported: {', '.join(FAMILIES)}")
        base = hf_model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        blocks = []
        for layer in base.layers:
            window = family.window(config, layer.self_attn)
            attn = HFResidual(layer.self_attn, getattr(layer, family.attn_norm), family.post_norm, self.rotary, window)
            mlp = HFResidual(layer.mlp, getattr(layer, family.mlp_norm), family.post_norm)
            blocks.append(nn.Sequential(OrderedDict(attn=attn, mlp=mlp)))  # a block: attn, then mlp
        self.blocks = nn.ModuleList(blocks)
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        max_pos = getattr(config, "max_position_embeddings", None) or seq_len
        self.cfg = HFInfo(config.model_type, config.hidden_size, config.vocab_size, len(blocks), min(seq_len, max_pos))

    # embed → blocks → norm → lm_head, the chain the metrics walk: LM's own methods, on the HF modules above
    sublayers, head, forward = LM.sublayers, LM.head, LM.forward
